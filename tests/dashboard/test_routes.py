"""The page and its files as ``skytrain serve`` serves them, read without a browser."""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urljoin

import httpx
import pytest

from tests.fixtures.service import Service, start_service, stop_service

# Where index.html and the scripts name other files: src/href attributes and module imports.
REFERENCE = re.compile(r'(?:src|href)="([^"#]+)"|(?:from|import)\s+"([^"]+)"')
CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """``skytrain serve`` on SQLite, starting no workers."""
    service = start_service({"SKYTRAIN_PROVIDER": "none"}, tmp_path_factory.mktemp("routes"))
    yield service
    stop_service(service)


@pytest.mark.slow
def test_the_page_is_served_at_the_root_with_a_policy_that_keeps_it_on_this_server(
    control_plane: Service,
) -> None:
    page = httpx.get(f"{control_plane.url}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/js/app.js" type="module">' in page.text
    policy = page.headers["content-security-policy"]
    for directive in ("default-src 'self'", "script-src 'self'", "connect-src 'self'"):
        assert directive in policy, policy
    assert page.headers["cache-control"] == "no-cache"
    assert httpx.head(f"{control_plane.url}/").status_code == 200


def test_every_file_the_page_loads_comes_from_the_package(control_plane: Service) -> None:
    """Follows index.html's links and every module's imports: all of them are on this server
    (nothing from a CDN: the page works offline) and are served with their type."""
    pending, seen = [f"{control_plane.url}/"], set()
    while pending:
        url = pending.pop()
        if url in seen:
            continue
        seen.add(url)
        response = httpx.get(url)
        assert response.status_code == 200, url
        suffix = url[url.rfind(".") :]
        if suffix in CONTENT_TYPES:
            assert response.headers["content-type"].startswith(CONTENT_TYPES[suffix]), url
        if url.endswith("/") or suffix in (".js", ".html"):
            for match in REFERENCE.finditer(response.text):
                reference = match.group(1) or match.group(2)
                target = urljoin(url, reference)
                assert target.startswith(f"{control_plane.url}/dashboard/"), (url, reference)
                pending.append(target)
    assert f"{control_plane.url}/dashboard/vendor/uplot/uPlot.iife.min.js" in seen
    assert f"{control_plane.url}/dashboard/js/pages/trajectories.js" in seen
    assert len(seen) > 15


def test_the_api_its_docs_and_health_keep_their_places(control_plane: Service) -> None:
    assert httpx.get(f"{control_plane.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{control_plane.url}/docs").status_code == 200
    paths = httpx.get(f"{control_plane.url}/openapi.json").json()["paths"]
    assert "/v1/models" in paths and "/" not in paths
    unknown = httpx.get(f"{control_plane.url}/v1/no-such-route")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    missing = httpx.get(f"{control_plane.url}/dashboard/js/no-such-file.js")
    assert missing.status_code == 404
