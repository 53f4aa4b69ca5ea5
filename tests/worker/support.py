"""Helpers the worker tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skytrain_backend.protocol import WorkerCapacity, WorkerRegistration
from skytrain_backend.worker.options import AgentOptions


def agent_options(model: Path, work_dir: Path, **more: Any) -> AgentOptions:
    """A worker agent's options for ``model``, registering a front door that is never
    reached; ``more`` are other options (``device``, ...)."""
    return AgentOptions(
        registration=WorkerRegistration(
            base_model=str(model),
            served_model_name="tiny",
            engine_secret="unused-engine-secret",
            port=1,
            certificate="unused",
            capacity=WorkerCapacity(max_models=8),
        ),
        work_dir=work_dir,
        **more,
    )
