"""Helpers the worker tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skytrain_backend.worker.options import AgentOptions


def agent_options(model: Path, work_dir: Path, **more: Any) -> AgentOptions:
    """A worker agent's options for ``model`` with no engine to reach (port 0, no
    certificate or engine secret); ``more`` are other options (``device``, ...)."""
    return AgentOptions(
        base_model=str(model),
        served_model_name="tiny",
        work_dir=work_dir,
        port=0,
        certificate="",
        engine_secret="",
        **more,
    )
