"""The skytrain wheel workers install: exactly the control plane's own version.

No package index needs to carry skytrain: the control plane serves its own wheel to workers
that hold a token (``GET /v1/worker/package``), and a worker's setup installs it (see
sky/worker.yaml). The wheel is, in this order:

- ``SKYTRAIN_WORKER_WHEEL``, a file the operator names (it must be this version);
- built from the source tree when skytrain is installed from one in editable mode
  (``pip wheel``, with the project's own build backend);
- otherwise packed again from the installed distribution's files, as its RECORD lists them
  (the modules, the migrations and SkyPilot tasks it ships, its metadata and entry points).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from wheel.wheelfile import WheelFile

from skytrain_backend import __version__
from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError

logger = logging.getLogger(__name__)

DISTRIBUTION = "skytrain"
WHEEL_NAME = f"{DISTRIBUTION}-{__version__}-py3-none-any.whl"
BUILD_TIMEOUT_S = 600.0
# Files of an installed distribution that the installer wrote, not the wheel.
_INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})


class WorkerPackage:
    """The wheel, found or made once per control plane process (thread-safe)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._directory = settings.storage.home / "dist"
        self._lock = threading.Lock()
        self._path: Path | None = None

    def path(self) -> Path:
        with self._lock:
            if self._path is None or not self._path.is_file():
                self._path = self._locate()
            return self._path

    def _locate(self) -> Path:
        given = self._settings.worker.wheel
        if given is not None:
            if given.name != WHEEL_NAME or not given.is_file():
                raise ConfigurationError(
                    f"SKYTRAIN_WORKER_WHEEL is {given}, but workers must install this control "
                    f"plane's version: point it at an existing {WHEEL_NAME}"
                )
            return given
        distribution = metadata.distribution(DISTRIBUTION)
        self._directory.mkdir(parents=True, exist_ok=True)
        source = editable_source(distribution)
        if source is not None:
            return build_wheel(source, self._directory)
        return repack_wheel(distribution, self._directory)


def editable_source(distribution: metadata.Distribution) -> Path | None:
    """The source tree of an editable install (pip's direct_url.json), else None."""
    text = distribution.read_text("direct_url.json")
    if not text:
        return None
    direct_url = json.loads(text)
    if not direct_url.get("dir_info", {}).get("editable"):
        return None
    return Path(unquote(urlparse(direct_url["url"]).path))


def build_wheel(source: Path, directory: Path) -> Path:
    """``pip wheel`` of the source tree, into ``directory``."""
    logger.info("building the worker wheel from %s", source)
    with tempfile.TemporaryDirectory(dir=directory) as staging:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", staging, source],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        built = Path(staging) / WHEEL_NAME
        if result.returncode != 0 or not built.is_file():
            raise ConfigurationError(
                f"building the worker wheel from {source} failed: {result.stderr[-2000:]} "
                f"(set SKYTRAIN_WORKER_WHEEL to a built {WHEEL_NAME} instead)"
            )
        target = directory / WHEEL_NAME
        shutil.move(built, target)
    return target


def repack_wheel(distribution: metadata.Distribution, directory: Path) -> Path:
    """The installed distribution's own files as a wheel again (its RECORD is rewritten)."""
    target = directory / WHEEL_NAME
    with tempfile.TemporaryDirectory(dir=directory) as staging:
        packed = Path(staging) / WHEEL_NAME
        with WheelFile(packed, "w") as wheel:
            for file in distribution.files or []:
                name = file.as_posix()
                if name.startswith("../") or "__pycache__" in file.parts or name.endswith(".pyc"):
                    continue
                if file.parts[0].endswith(".dist-info") and file.name in _INSTALLER_FILES:
                    continue
                wheel.write(str(file.locate()), arcname=name)
        shutil.move(packed, target)
    return target
