"""The web dashboard: a single page served by the control plane at ``/``.

The page (``static/``: HTML, CSS and plain JavaScript modules, no build step) reads the same
REST API as every other client, with the API key the user signs in with (kept in the
browser's local storage), so it sees exactly what that key may see. Its chart library, uPlot,
ships in ``static/vendor/``: nothing is loaded from elsewhere, and the Content-Security-Policy
tells the browser so. Assets are revalidated on every load (``no-cache`` with ETags), so a
new version of skytrain is never shown with an old script.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"
ASSETS_PATH = "/dashboard"

# Scripts and styles from this origin only; the page talks to this API only.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _Assets(StaticFiles):
    """The page's files, with the dashboard's headers on every answer."""

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


def install_dashboard(app: FastAPI) -> None:
    """Serve the page at ``/`` and its assets under ``/dashboard/``."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=HEADERS)

    app.mount(ASSETS_PATH, _Assets(directory=STATIC_DIR), name="dashboard")
