"""Providers that start and stop workers: ``local`` (subprocesses) and ``skypilot``."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.provision.base import ClusterInfo, Provider, WorkerLaunch

__all__ = ["ClusterInfo", "Provider", "WorkerLaunch", "open_provider"]


def open_provider(settings: Settings, sessions: sessionmaker[Session]) -> Provider | None:
    """The provider the settings name (None for ``none``: workers join by hand only)."""
    if settings.scheduler.provider == "local":
        from skytrain_backend.provision.local import LocalProvider

        return LocalProvider(
            log_dir=settings.storage.home / "workers",
            sessions=sessions,
            envs={
                "SKYTRAIN_HOME": str(settings.storage.home),
                "SKYTRAIN_MODEL_CACHE_DIR": str(settings.storage.resolved_model_cache_dir),
                # The worker's and its engine's lines in the control plane's format.
                "SKYTRAIN_LOG_FORMAT": settings.observability.log_format,
            },
        )
    if settings.scheduler.provider == "skypilot":
        from skytrain_backend.provision.skypilot import SkyPilotProvider

        return SkyPilotProvider(settings)
    return None
