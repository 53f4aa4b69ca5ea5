"""One training job from files, in the process(es) that run it: the trainer's entry point
under ``torchrun``.

``python -m skytrain_backend.trainer.job SPEC.json`` (one ``JobSpec``, or a list of them run
one after the other by the same processes) loads the trainer (sharded over the
processes ``torchrun`` started, ``distributed``; one process without it), prepares the job
from the data file the spec names, runs its steps and saves the checkpoint (rank 0 writes).
Every rank reads the same spec and data, so every rank makes the same plan. Rank 0 appends
what happens to ``metrics_path``, one JSON object a line: ``{"event": "prepared", "plan":
{...}}`` (the plan's steps, summary and warning), ``{"event": "step", "metrics": {...}}``
after each step, and ``{"event": "saved"}`` or ``{"event": "stopped"}`` at the end. It
writes the checkpoint to ``output_dir``: the adapter at the next step, or the job's progress
(``Trainer.save_progress``), which a spec with ``resume_from`` continues, when it stops
between two steps: after ``stop_after`` steps, or when the worker says so.

With ``control_dir`` the worker drives the steps as it drives an in-process trainer: after
step ``k`` (not the last) rank 0 waits for ``go-k`` (the next step) or ``stop`` (save the
progress: the worker yields to another job) to appear there, and every rank follows it.

Ranks on other nodes than the head's (a worker of several nodes) run ``... job --follow
DIRECTORY`` instead (``worker.follower``): rank 0 sends them the specs and every file a job
reads (``follow_jobs``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from skytrain_backend.child_processes import die_with_parent
from skytrain_backend.protocol import (
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from skytrain_backend.trainer.distributed import Shards
from skytrain_backend.trainer.plans import PackingKind

if TYPE_CHECKING:
    from skytrain_backend.trainer.trainer import RLPlan, SFTPlan, Trainer


class JobSpec(BaseModel):
    """What one run of the job entry point does (written by the worker, or a test)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    kind: Literal["rl", "sft"]
    base_model: str
    lora: ModelConfig
    # RLTrainConfig or SFTTrainConfig as JSON.
    config: dict[str, Any]
    # A JSON list of trajectory groups (rl) or trajectories (sft).
    data_path: Path
    output_dir: Path
    metrics_path: Path
    # The checkpoint the job starts from (None: a fresh adapter).
    adapter_dir: Path | None = None
    # A stopped job's directory (save_progress): the job continues from it.
    resume_from: Path | None = None
    # Stop after this many steps and save the job's progress instead of finishing.
    stop_after: int | None = Field(default=None, ge=1)
    # Where the worker says "go-K" or "stop" after step K (None: run every step).
    control_dir: Path | None = None
    device: str | None = None
    packing: PackingKind | None = None
    gradient_checkpointing: bool | None = None
    max_row_tokens: int | None = Field(default=None, ge=1)


# How often rank 0 looks for the worker's word between two steps.
CONTROL_POLL_S = 0.05

_JOBS: TypeAdapter[JobSpec | list[JobSpec]] = TypeAdapter(JobSpec | list[JobSpec])


def _read(spec: JobSpec) -> list[TrajectoryGroup] | list[Trajectory]:
    data = json.loads(spec.data_path.read_text())
    if spec.kind == "rl":
        return [TrajectoryGroup.model_validate(group) for group in data]
    return [Trajectory.model_validate(trajectory) for trajectory in data]


def _prepare(
    trainer: Trainer, spec: JobSpec, data: list[TrajectoryGroup] | list[Trajectory]
) -> RLPlan | SFTPlan:
    if spec.kind == "rl":
        groups = cast(list[TrajectoryGroup], data)
        return trainer.prepare_rl(
            groups, RLTrainConfig.model_validate(spec.config), resume_from=spec.resume_from
        )
    trajectories = cast(list[Trajectory], data)
    return trainer.prepare_sft(
        trajectories, SFTTrainConfig.model_validate(spec.config), resume_from=spec.resume_from
    )


def run_job(spec: JobSpec, shards: Shards) -> None:
    """Run ``spec`` as this rank of ``shards``. The data is read first: a batch it cannot
    train on fails before the base model loads."""
    data = _read(spec)
    # transformers and peft load with the trainer, after the data is known to be good.
    from skytrain_backend.trainer.trainer import Trainer

    trainer = Trainer.load(
        spec.base_model,
        model_config=spec.lora,
        adapter_dir=spec.resume_from or spec.adapter_dir,
        device=spec.device,
        gradient_checkpointing=spec.gradient_checkpointing,
        max_row_tokens=spec.max_row_tokens,
        packing=spec.packing,
        shards=shards,
    )
    plan = _prepare(trainer, spec, data)

    def tell(event: dict[str, Any]) -> None:
        if shards.is_main:
            with spec.metrics_path.open("a") as out:
                out.write(json.dumps(event) + "\n")

    tell(
        {
            "event": "prepared",
            "plan": {
                "num_gradient_steps": plan.num_gradient_steps,
                "steps_done": plan.steps_done,
                "summary": plan.summary,
                "warning": plan.warning,
            },
        }
    )
    for metrics in trainer.run(plan):
        tell(
            {
                "event": "step",
                "steps_done": plan.steps_done,
                "metrics": metrics,
                "summary": plan.summary,
                "warning": plan.warning,
            }
        )
        if plan.steps_done == plan.num_gradient_steps:
            continue
        told = _wait_for_word(spec.control_dir, plan.steps_done) if shards.is_main else False
        stopping = shards.any(told) or plan.steps_done == spec.stop_after
        if stopping:
            trainer.save_progress(plan, spec.output_dir)
            tell({"event": "stopped", "steps_done": plan.steps_done, "summary": plan.summary})
            return
    trainer.save(spec.output_dir)
    tell({"event": "saved", "summary": plan.summary, "warning": plan.warning})


def _wait_for_word(control_dir: Path | None, steps_done: int) -> bool:
    """Whether the worker says stop after ``steps_done`` steps (False: go on)."""
    if control_dir is None:
        return False
    while True:
        if (control_dir / "stop").exists():
            return True
        if (control_dir / f"go-{steps_done}").exists():
            return False
        time.sleep(CONTROL_POLL_S)


def follow_jobs(specs: list[JobSpec] | None, shards: Shards, into: Path | None) -> None:
    """Run ``specs`` (rank 0's: the others' may be None) as this rank of ``shards``. A rank
    given ``into`` (a follower on another node, ``worker.follower``) has none of the worker's
    files: rank 0 sends it the specs, then each job's data and checkpoints as the job starts
    (a job may resume from what the one before it saved), written under ``into``."""
    if not shards.any(into is not None):
        assert specs is not None
        for spec in specs:
            run_job(spec, shards)
        return
    text = shards.broadcast(
        _SPECS.dump_json(specs).decode() if shards.is_main and specs is not None else None
    )
    for index, spec in enumerate(_SPECS.validate_json(text)):
        local = into / f"job-{index}" if into is not None else None
        found = shards.share(
            {"data": spec.data_path, "adapter": spec.adapter_dir, "resume": spec.resume_from},
            local,
        )
        if local is not None:
            # What only rank 0 writes or reads goes to this node's own directory.
            data = found["data"]
            assert data is not None
            spec = spec.model_copy(
                update={
                    "data_path": data,
                    "adapter_dir": found["adapter"],
                    "resume_from": found["resume"],
                    "output_dir": local / "out",
                    "metrics_path": local / "events.jsonl",
                    "control_dir": None,
                }
            )
        run_job(spec, shards)


_SPECS: TypeAdapter[list[JobSpec]] = TypeAdapter(list[JobSpec])
USAGE = "usage: python -m skytrain_backend.trainer.job SPEC.json | --follow DIRECTORY"


def main(argv: list[str] | None = None) -> int:
    # torchrun starts each rank in a session of its own and ties it to nothing: a worker
    # killed (and its torchrun with it) would leave the ranks waiting for its word for ever,
    # holding their GPU.
    die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2) != (args[0] == "--follow"):
        print(USAGE, file=sys.stderr)
        return 2
    into = Path(args[1]) if len(args) == 2 else None
    specs: list[JobSpec] | None = None
    if into is None:
        read = _JOBS.validate_json(Path(args[0]).read_text())
        specs = read if isinstance(read, list) else [read]
    shards = Shards.from_environment()
    if into is not None and shards.is_main:
        print("--follow is for the ranks of other nodes than the head's", file=sys.stderr)
        return 2
    try:
        follow_jobs(specs, shards, into)
    finally:
        shards.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
