"""Where a job stands between two optimizer steps, so that it can stop there and resume
elsewhere exactly.

A job stopped at a step boundary (a worker yielding its GPU to another tenant's job) is
saved as a checkpoint directory at the job's base step (the adapter, the optimizer state and
``trainer_state.json``, as ``Trainer.save`` writes them) plus ``progress.pt``: the steps done,
the random number generators' states after the last of them, the metrics of every step so
far, the plan's summary and warning, and for RL the old logprobs of the steps still to run
(read before the first update; the policy has moved since, so they cannot be read again).
Everything else a step needs follows from the job's input and config, which the control plane
keeps: the split of the groups into steps and SFT's epoch shuffles are seeded, so preparing
the job again gives the same steps, and a resumed run skips the ones done. There is no
learning-rate schedule beyond SFT's per-step list, which the step position indexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from skytrain_backend.errors import TrainingError

PROGRESS = "progress.pt"
# Raised when what progress.pt holds changes shape; an older file is refused, never misread.
PROGRESS_FORMAT = 1

Metrics = dict[str, float]
PlanKind = Literal["rl", "sft"]


@dataclass
class RandomState:
    """torch's generators (CPU, and the device's on CUDA) as a step left them, so a resumed
    plan goes on with them as the uninterrupted one would (LoRA dropout's masks come from a
    generator per row, seeded by the job, the step and the row, and need none of this)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device) -> RandomState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(cpu=torch.get_rng_state(), cuda=cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and device.type == "cuda":
            torch.cuda.set_rng_state(self.cuda, device)


@dataclass
class Position:
    """How far a plan has run: its steps done, their metrics, and the generators after them."""

    steps_done: int = 0
    metrics: list[Metrics] = field(default_factory=list)
    random_state: RandomState | None = None

    def advance(self, metrics: Metrics, device: torch.device) -> None:
        self.steps_done += 1
        self.metrics.append(metrics)
        self.random_state = RandomState.capture(device)


@dataclass
class Progress:
    """What ``progress.pt`` holds."""

    kind: PlanKind
    base_step: int
    num_steps: int
    position: Position
    summary: Metrics
    warning: str | None
    # RL: per step still to run, per row, the old logprob of each prediction site.
    old_logprobs: list[list[torch.Tensor]] = field(default_factory=list)

    def write(self, directory: Path) -> None:
        assert self.position.random_state is not None
        state = {
            "format": PROGRESS_FORMAT,
            "kind": self.kind,
            "base_step": self.base_step,
            "num_steps": self.num_steps,
            "steps_done": self.position.steps_done,
            "metrics": self.position.metrics,
            "random_state": {
                "cpu": self.position.random_state.cpu,
                "cuda": self.position.random_state.cuda,
            },
            "summary": self.summary,
            "warning": self.warning,
            "old_logprobs": [[row.cpu() for row in rows] for rows in self.old_logprobs],
        }
        torch.save(state, directory / PROGRESS)

    @classmethod
    def read(cls, directory: Path, *, kind: PlanKind, base_step: int, num_steps: int) -> Progress:
        """The progress saved in ``directory`` for a plan of ``kind`` prepared at
        ``base_step`` with ``num_steps`` steps; TrainingError when it is another job's."""
        path = directory / PROGRESS
        if not path.is_file():
            raise TrainingError(f"{directory} holds no {PROGRESS}: it is not a job's saved state")
        try:
            state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise TrainingError(f"{path} cannot be read ({exc})") from exc
        if state.get("format") != PROGRESS_FORMAT:
            raise TrainingError(
                f"{path} was written in format {state.get('format')!r}, this trainer reads "
                f"{PROGRESS_FORMAT}: resume the job with the skytrain version that saved it"
            )
        found = (state["kind"], state["base_step"], state["num_steps"])
        if found != (kind, base_step, num_steps):
            raise TrainingError(
                f"the saved state in {directory} is of a {found[0]} job of {found[2]} steps "
                f"from step {found[1]}, not of this {kind} job of {num_steps} steps from step "
                f"{base_step}: it belongs to another job"
            )
        random_state = RandomState(**state["random_state"])
        return cls(
            kind=kind,
            base_step=base_step,
            num_steps=num_steps,
            position=Position(
                steps_done=int(state["steps_done"]),
                metrics=list(state["metrics"]),
                random_state=random_state,
            ),
            summary=dict(state["summary"]),
            warning=state["warning"],
            old_logprobs=[list(rows) for rows in state["old_logprobs"]],
        )
