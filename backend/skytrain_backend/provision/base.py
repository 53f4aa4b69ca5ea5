"""What a provider is: something that starts, watches and stops worker machines.

The scheduler decides *when* a worker is needed (a model with no worker for its base model,
idle workers to stop); a provider only carries it out. Providers are synchronous and never
block the caller for long: ``launch`` returns at once and the launch goes on in the
background; ``poll`` reports what became of it. The control plane calls them from a worker
thread, never on the event loop.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal

from skytrain_backend.json_types import JSONObject

ClusterState = Literal["launching", "up", "failed", "gone"]


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything a provider needs to start one worker."""

    worker_id: str
    base_model: str
    control_plane_url: str
    # The worker registers with this token; it identifies the worker row.
    join_token: str
    # The engine answers only requests carrying this secret (exposed engines on clouds).
    engine_secret: str
    # Extra SKYTRAIN_* settings for the worker process (engine kind, timeouts...).
    envs: dict[str, str] = field(default_factory=dict)
    accelerators: str | None = None
    # The base model's config.json as the control plane read it (the Hub's, kept in the
    # object store): what a provider that chooses GPUs plans with. None: not known here.
    base_model_config: JSONObject | None = None
    # The largest LoRA rank among the models the worker is launched for: what it is planned
    # at and its engine loads (``envs`` give it as SKYTRAIN_ENGINE_MAX_LORA_RANK). None: the
    # largest a worker may load (a local worker, which plans for itself).
    lora_rank: int | None = None


@dataclass(frozen=True)
class ClusterInfo:
    """A provider's view of one worker machine."""

    worker_id: str
    cluster_name: str
    state: ClusterState
    # The worker's front door (https) as the control plane reaches it, when known.
    engine_endpoint: str | None = None
    # The provider's own words on why a launch failed or a cluster went away.
    message: str | None = None


@dataclass(frozen=True)
class StartupReport:
    """What a provider knows of a launched worker that has not registered yet."""

    # Its process has ended (SkyPilot: the cluster's job, setup included, finished): it will
    # never register.
    ended: bool
    # The provider's own words: the job's state and, once it ended or when asked, its last
    # log lines. For the operator (`skytrain workers list`), never the tenant.
    detail: str


class Provider(abc.ABC):
    """Starts and stops workers; see the module docstring."""

    name: str

    @abc.abstractmethod
    def launch(self, launch: WorkerLaunch) -> str:
        """Start a worker in the background; return its cluster name at once."""

    @abc.abstractmethod
    def poll(self) -> list[ClusterInfo]:
        """Every cluster this provider started that it still knows about."""

    @abc.abstractmethod
    def terminate(self, cluster_name: str) -> None:
        """Stop a worker and release its machine. Stopping one that is gone is not an error."""

    def accelerator_choices(self) -> list[str] | None:
        """The GPUs (``'L4:1'``...) a worker of this provider may get, or None when the
        provider does not choose them (a local worker uses what its machine has)."""
        return None

    def startup_report(self, cluster_name: str, *, with_log: bool = False) -> StartupReport | None:
        """What became of the worker on ``cluster_name``, launched and up but not registered
        yet; ``with_log`` asks for its last log lines even while it runs (the scheduler is
        about to give up on it). None: nothing known (yet). Cheap to call every pass: a
        provider that has to ask a remote service spaces its questions out."""
        return None

    def stop_orphans(self) -> list[str]:
        """At start-up: stop the workers that an earlier control plane started and left
        behind; returns their ids (the scheduler records them stopped)."""
        return []

    def close(self) -> list[str]:
        """Release what the provider holds (threads, subprocesses) at control plane shutdown.

        Returns the ids of the workers this stopped (workers that do not outlive the control
        plane), so that their jobs are released; workers on machines of their own keep
        running and are found again by the next control plane.
        """
        return []
