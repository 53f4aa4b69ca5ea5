"""What the worker agent is told at start: its engine, its front door, its limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from skytrain_backend.protocol import WorkerRegistration
from skytrain_backend.worker.sizing import TrainerSizing


@dataclass
class AgentOptions:
    # What the worker registers as: its base model and engine, its front door (port,
    # certificate, URL when it knows it), its capacity, hardware and version.
    registration: WorkerRegistration
    work_dir: Path
    # Put the engine to sleep while training (an engine sharing the GPU with the trainer).
    sleep_engine_during_training: bool = False
    # How long a sleep waits for requests in flight (then aborts them), and how long the sleep
    # itself, or a wake-up, may take.
    engine_sleep_wait_s: float = 300.0
    engine_sleep_timeout_s: float = 600.0
    # How long an adapter no longer placed here stays loaded for its requests in flight.
    unload_wait_s: float = 300.0
    device: str | None = None
    # Most bytes one training step's activations may take (None: the trainer's default).
    trainer_memory_limit_bytes: int | None = None
    # Trainer.load's memory-plan keywords (gradient_checkpointing, max_row_tokens, spread).
    trainer_options: TrainerSizing = field(default_factory=TrainerSizing)
    # Trainer processes a job runs on (the plan's trainer_shards): more than 1, under
    # torchrun with the base model sharded (worker.sharded).
    trainer_shards: int = 1
    # The interpreter of the Unsloth trainer's environment (worker.trainer_python): each job's
    # trainer runs there as a process of its own (worker.sharded, one rank). None: in process.
    trainer_python: str | None = None
    # How long one lease request waits on the control plane for a job (a long-poll: a job
    # queued meanwhile is answered at once).
    job_wait_s: float = 30.0
    max_cached_trainers: int = 2
    # Tinker training runs held at once (worker.tinker_runs), beside the job loop.
    tinker_max_runs: int = 2

    @property
    def base_model(self) -> str:
        return self.registration.base_model
