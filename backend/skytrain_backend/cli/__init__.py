"""The ``skytrain`` command line: one Typer app, its commands in a module per group.

- ``control``: ``serve``, ``keys``, ``tenants``, ``db``, ``engine``;
- ``workers``: ``worker``, ``workers``, ``jobs``, ``logs``;
- ``models``: ``models list|show|delete`` (every tenant's, for the operator);
- ``status``: the whole deployment on one screen;
- ``storage``: ``storage check`` (rows whose objects are missing or damaged);
- ``demo``.

Every command imports what it needs inside its function, so ``skytrain --help`` and the
control plane's commands never load torch.
"""

from __future__ import annotations

import typer

from skytrain_backend.cli import control, demo, models, status, storage, workers
from skytrain_backend.cli._common import app

__all__ = ["app", "control", "demo", "main", "models", "status", "storage", "workers"]


def main() -> None:
    """``skytrain``: the app; a setting whose environment variable has a wrong value is a short
    error naming the variable, from whichever command read the settings first."""
    from pydantic import ValidationError

    from skytrain_backend.config import wrong_variables

    try:
        app()
    except ValidationError as exc:
        wrong = wrong_variables(exc)
        if wrong is None:
            raise
        for line in wrong:
            typer.echo(f"error: {line}", err=True)
        typer.echo(
            "  fix or unset it (docs/operators.md#configuration lists every setting)", err=True
        )
        raise SystemExit(1) from None
