"""The reverse proxy shipped in front of the control plane (infra/nginx/nginx.conf): nginx
itself accepts it, with the limits the docs promise. Skipped where nginx is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from skytrain_backend import tls

CONFIG = Path(__file__).resolve().parents[2] / "infra" / "nginx" / "nginx.conf"


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_accepts_the_shipped_proxy_config(tmp_path: Path) -> None:
    certificate, key = tls.self_signed_certificate(["skytrain.example.com"])
    (tmp_path / "fullchain.pem").write_text(certificate)
    (tmp_path / "privkey.pem").write_text(key)
    # As sky/control-plane.yaml installs it: the server on loopback, a certificate of its own.
    config = (
        CONFIG.read_text()
        .replace("server skytrain:8000;", "server 127.0.0.1:8000;")
        .replace("/etc/nginx/tls/", f"{tmp_path}/")
    )
    (tmp_path / "nginx.conf").write_text(config)
    nginx = shutil.which("nginx")
    assert nginx is not None
    result = subprocess.run(
        [nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    for limit in ("client_header_timeout 30s", "limit_conn per_address", "keepalive_requests"):
        assert limit in config
    # A broken config is refused: the check is live.
    (tmp_path / "nginx.conf").write_text(config.replace("limit_conn_zone", "limit_conn_zon"))
    broken = subprocess.run(
        [nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert broken.returncode != 0 and "limit_conn_zon" in broken.stderr, broken.stderr
