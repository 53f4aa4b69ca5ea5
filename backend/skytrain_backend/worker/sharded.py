"""Training a job on more than one GPU: the trainer as ``torchrun`` processes.

When the worker's memory plan shards the trainer (``trainer_shards`` > 1: the base model's
weights do not fit one GPU beside what training needs), the worker does not load the trainer
in its own process: its job loop gets a ``ShardedTrainer``, which answers the same calls.
For each job it writes a ``trainer.job.JobSpec`` and the job's data, and runs ``python -m
torch.distributed.run ... -m skytrain_backend.trainer.job SPEC`` (torchrun): one process a
GPU, the base sharded over them with FSDP2 (``trainer.distributed``). Rank 0 reports the
plan and each step (an events file the worker reads), waits between two steps for the
worker's word (``go-K`` or ``stop`` in the job's control directory), and writes the
checkpoint or the stopped job's state, which the worker uploads as its own trainer's.

Where the processes meet (torchrun's rendezvous):

- one node: ``--standalone`` (a local rendezvous on a free port);
- several nodes (a SkyPilot task with ``num_nodes``): SkyPilot gives every node the same
  ``SKYPILOT_NODE_IPS`` (one address a line, the head first) and its own
  ``SKYPILOT_NODE_RANK``; every node runs torchrun with ``--nnodes``, ``--node-rank`` and
  the head's address as ``--master-addr`` (``Rendezvous.from_skypilot``): the head worker
  for each job, the other nodes' followers (``worker.follower``) waiting for it, which
  rank 0 sends the job's files to (``trainer.job.follow_jobs``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, Unpack, cast

from skytrain_backend.child_processes import ChildProcess
from skytrain_backend.errors import ConfigurationError, TrainingError
from skytrain_backend.protocol import (
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    TrainerEvent,
    TrainerEventData,
    TrainerEventName,
    Trajectory,
    TrajectoryGroup,
)
from skytrain_backend.trainer.job import JobSpec
from skytrain_backend.trainer.plans import TRAINER_STATE
from skytrain_backend.trainer.progress import PROGRESS

if TYPE_CHECKING:
    from skytrain_backend.trainer import Trainer

logger = logging.getLogger(__name__)

# torchrun's default rendezvous port; SKYTRAIN_TRAINER_MASTER_PORT overrides it.
DEFAULT_MASTER_PORT = 29500
# The last lines of a failed run's output the worker's log gets.
ERROR_TAIL_LINES = 40
# How often the worker reads rank 0's events while a step runs.
EVENT_POLL_S = 0.1
# How long the ranks of a released trainer get to end before they are killed.
STOP_TIMEOUT_S = 30.0
# How long the ranks may take to exit once they said they saved or stopped (process groups'
# teardown); past it they are stopped: their output is written and the port must be free.
EXIT_GRACE_S = 120.0


class PreparedPlan(TypedDict):
    num_gradient_steps: int
    steps_done: int
    summary: dict[str, float]
    warning: str | None


class RankEvent(TypedDict):
    """A line of rank 0's events file (``trainer.job`` writes it): ``event`` says which of
    prepared (``plan``), step (``steps_done``, ``metrics``, ``summary``, ``warning``),
    stopped (``steps_done``, ``summary``) or saved (``summary``, ``warning``) it is."""

    event: Literal["prepared", "step", "stopped", "saved"]
    plan: NotRequired[PreparedPlan]
    steps_done: NotRequired[int]
    metrics: NotRequired[dict[str, float]]
    summary: NotRequired[dict[str, float]]
    warning: NotRequired[str | None]


@dataclass(frozen=True)
class Rendezvous:
    """Where a trainer's processes meet: ``nodes`` nodes of ``gpus_per_node`` processes."""

    gpus_per_node: int
    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def from_skypilot(cls, env: Mapping[str, str], *, gpus_per_node: int) -> Rendezvous:
        """The rendezvous SkyPilot's environment describes (one node without it)."""
        ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
        port = int(env.get("SKYTRAIN_TRAINER_MASTER_PORT", DEFAULT_MASTER_PORT))
        if len(ips) <= 1:
            return cls(gpus_per_node=gpus_per_node, master_port=port)
        rank_text = env.get("SKYPILOT_NODE_RANK")
        if rank_text is None or not rank_text.isdigit() or int(rank_text) >= len(ips):
            raise ConfigurationError(
                f"SKYPILOT_NODE_IPS names {len(ips)} nodes but SKYPILOT_NODE_RANK is "
                f"{rank_text!r}: a multi-node trainer needs this node's rank (0..{len(ips) - 1})"
            )
        return cls(
            gpus_per_node=gpus_per_node,
            nodes=len(ips),
            node_rank=int(rank_text),
            master_addr=ips[0],
            master_port=port,
        )

    def torchrun_args(self) -> list[str]:
        args = [f"--nproc-per-node={self.gpus_per_node}"]
        if self.nodes == 1:
            return [*args, "--standalone"]
        return [
            *args,
            f"--nnodes={self.nodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
        ]


def torchrun_command(
    spec_path: Path, rendezvous: Rendezvous, *, python: str | None = None
) -> list[str]:
    """The command that runs the job in ``spec_path`` as ``rendezvous``'s processes, under
    ``python`` (default: this interpreter)."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous.torchrun_args(),
        "-m",
        "skytrain_backend.trainer.job",
        str(spec_path),
    ]


def follower_command(directory: Path, rendezvous: Rendezvous) -> list[str]:
    """The command that runs this node's ranks of the next sharded job the head starts, with
    the files rank 0 sends written under ``directory`` (``worker.follower``)."""
    return [*torchrun_command(Path("--follow"), rendezvous), str(directory)]


@dataclass
class ShardedPlan:
    """What the worker's job loop reads of a plan (as of ``trainer.RLPlan``), filled in as
    rank 0 reports it: the steps once the ranks prepared the job, the rest after each step."""

    spec: Any
    num_gradient_steps: int = 0
    steps_done: int = 0
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    warning: str | None = None
    # Like an in-process plan whose first step measures the sampler agreement: the worker
    # reports the job started after the first step.
    agreement_pending: bool = True
    finished: bool = False
    # How far rank 0's events file has been read.
    events_read: int = 0


class ShardedTrainer:
    """The worker's trainer when the plan shards it: the same calls as ``trainer.Trainer``
    (``prepare_rl``/``prepare_sft``, ``run``, ``save``, ``save_progress``, ``release``,
    ``step``, ``events``), each job run by torchrun processes that load the base model,
    sharded, for that job (nothing stays in memory between jobs). ``run`` yields each step's
    metrics as rank 0 reports them and lets the ranks take the next step only when asked for
    it, so the worker yields to another job at a step boundary as it does with one process.
    """

    def __init__(
        self,
        base_model: str,
        *,
        model_config: ModelConfig,
        adapter_dir: Path | None,
        rendezvous: Rendezvous,
        work_dir: Path,
        device: str | None = None,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        python: str | None = None,
        exit_grace_s: float = EXIT_GRACE_S,
    ) -> None:
        self.base_model, self.model_config = base_model, model_config
        self.exit_grace_s = exit_grace_s
        # The interpreter the ranks run under (the Unsloth trainer's environment, or this one).
        self.python = python
        self.adapter_dir, self.rendezvous = adapter_dir, rendezvous
        self.work_dir, self.device, self.env = work_dir, device, dict(env or {})
        options = dict(options or {})
        self.gradient_checkpointing = options.get("gradient_checkpointing")
        self.max_row_tokens = options.get("max_row_tokens")
        state = adapter_dir / TRAINER_STATE if adapter_dir is not None else None
        self.step = json.loads(state.read_text()).get("step", 0) if state and state.is_file() else 0
        self.events: list[TrainerEvent] = []
        self.released = False
        self._process: ChildProcess | None = None
        self._runs = 0
        self._record("loaded", processes=rendezvous.world_size, step=self.step)

    def _record(self, event: TrainerEventName, **data: Unpack[TrainerEventData]) -> None:
        self.events.append(TrainerEvent(event=event, at=time.time(), **data))

    # --- preparing ---------------------------------------------------------------------------

    def prepare_rl(
        self,
        groups: Sequence[TrajectoryGroup],
        config: RLTrainConfig,
        *,
        resume_from: Path | None = None,
        reference: Path | None = None,
    ) -> ShardedPlan:
        if reference is not None:
            raise TrainingError(
                "a KL reference checkpoint (kl_penalty_reference_step, kl_penalty_step_lag) is "
                "not supported on a sharded trainer yet: leave them unset (the base model is "
                "the reference) or use a worker whose model fits one GPU"
            )
        return self._prepare("rl", [g.model_dump(mode="json") for g in groups], config, resume_from)

    def prepare_sft(
        self,
        trajectories: Sequence[Trajectory],
        config: SFTTrainConfig,
        *,
        resume_from: Path | None = None,
    ) -> ShardedPlan:
        data = [t.model_dump(mode="json") for t in trajectories]
        return self._prepare("sft", data, config, resume_from)

    def _prepare(
        self, kind: str, data: list[Any], config: Any, resume_from: Path | None
    ) -> ShardedPlan:
        if self.released:
            raise TrainingError("this trainer was released: load it again from its checkpoint")
        self._runs += 1
        run_dir = self.work_dir / f"run-{self._runs}"
        # Earlier runs' files go, but for the checkpoint this job starts from.
        for old in self.work_dir.glob("run-*"):
            if self.adapter_dir is None or not self.adapter_dir.is_relative_to(old):
                shutil.rmtree(old, ignore_errors=True)
        (run_dir / "control").mkdir(parents=True)
        (run_dir / "data.json").write_text(json.dumps(data))
        spec = JobSpec(
            kind=kind,
            base_model=self.base_model,
            lora=self.model_config,
            config=config.model_dump(mode="json"),
            data_path=run_dir / "data.json",
            output_dir=run_dir / "out",
            metrics_path=run_dir / "events.jsonl",
            adapter_dir=self.adapter_dir,
            resume_from=resume_from,
            control_dir=run_dir / "control",
            device=self.device,
            gradient_checkpointing=self.gradient_checkpointing,
            max_row_tokens=self.max_row_tokens,
        )
        (run_dir / "job.json").write_text(spec.model_dump_json())
        plan = ShardedPlan(spec=spec)
        if resume_from is not None:
            _resumed(plan, resume_from)
        return plan

    # --- running -----------------------------------------------------------------------------

    def run(self, plan: ShardedPlan) -> Iterator[dict[str, float]]:
        """Start the ranks on ``plan`` and yield each step's metrics; asking for the next one
        lets the ranks take the next step."""
        spec = plan.spec
        command = torchrun_command(
            spec.data_path.parent / "job.json", self.rendezvous, python=self.python
        )
        with (spec.data_path.parent / "output.log").open("wb") as log:
            self._process = ChildProcess.start(command, env={**os.environ, **self.env}, stdout=log)
        for event in self._events(plan):
            if event["event"] == "step":
                self._record("gradient_step", loss=event["metrics"].get("loss"))
                yield event["metrics"]
                if plan.steps_done < plan.num_gradient_steps:
                    (spec.control_dir / f"go-{plan.steps_done}").touch()
            elif event["event"] == "saved":
                plan.finished = True
                self.step += 1
                return
            elif event["event"] == "stopped":
                return

    def _events(self, plan: ShardedPlan) -> Iterator[RankEvent]:
        """Rank 0's events as it writes them, applied to ``plan``; TrainingError when the
        ranks end without saying they saved or stopped."""
        assert self._process is not None
        path = plan.spec.metrics_path
        while True:
            ended = self._process.poll() is not None
            lines: list[str] = []
            if path.is_file():
                with path.open("rb") as stream:
                    stream.seek(plan.events_read)
                    text = stream.read()
                complete = text[: text.rfind(b"\n") + 1]
                plan.events_read += len(complete)
                lines = complete.decode().splitlines()
            for line in lines:
                event: RankEvent = json.loads(line)
                _apply(plan, event)
                if event["event"] in ("saved", "stopped"):
                    # The ranks' last word: wait for them to exit before the caller hears
                    # it (a caller stops asking at this event, so nothing after the yield
                    # runs; the next job's torchrun would find this one's port still held).
                    self._wait_after_last_word()
                    yield event
                    return
                yield event
            if ended and not lines:
                self._wait()
                raise TrainingError("the sharded trainer's processes ended before the job did")
            if not lines:
                time.sleep(EVENT_POLL_S)

    def _wait(self) -> None:
        assert self._process is not None
        code = self._process.wait()
        if code != 0:
            log = self.work_dir / f"run-{self._runs}" / "output.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-ERROR_TAIL_LINES:])
            # The output names this machine's paths: the log has it, the error says where.
            logger.error("the sharded trainer failed:\n%s", tail)
            raise TrainingError(
                f"the sharded trainer ({self.rendezvous.world_size} processes) failed with exit "
                f"code {code}: the worker's log has its output"
            )

    def _wait_after_last_word(self) -> None:
        """The ranks said they saved or stopped: their output is written. Processes that do
        not exit within ``exit_grace_s`` (a hung teardown) are killed (nothing of theirs is
        left to keep, and torchrun's agent may take a SIGTERM for more waiting), and a
        non-zero exit now is logged, not the job's failure."""
        assert self._process is not None
        try:
            code = self._process.wait(timeout_s=self.exit_grace_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "the sharded trainer's processes had not exited %.0f s after writing the job's "
                "output: killing them",
                self.exit_grace_s,
            )
            self._process.kill()
            return
        if code != 0:
            logger.warning(
                "the sharded trainer's processes exited with code %d after writing the job's "
                "output: the output is kept",
                code,
            )

    def save_progress(self, plan: ShardedPlan, directory: Path) -> None:
        """Stop the ranks at this step boundary; they save the job's state, copied here."""
        if plan.finished or not 0 < plan.steps_done < plan.num_gradient_steps:
            raise RuntimeError("a plan is saved between two of its steps: save() a finished job")
        (plan.spec.control_dir / "stop").touch()
        for _ in self._events(plan):
            pass
        shutil.copytree(plan.spec.output_dir, directory, dirs_exist_ok=True)
        self._record("saved_progress", steps_done=plan.steps_done)

    def save(self, directory: Path) -> None:
        """The checkpoint the ranks wrote at the end of the last job, at ``step``."""
        source = self.work_dir / f"run-{self._runs}" / "out"
        shutil.copytree(source, directory, dirs_exist_ok=True)
        state_path = directory / TRAINER_STATE
        state = json.loads(state_path.read_text())
        state["step"] = self.step
        state_path.write_text(json.dumps(state, indent=2) + "\n")
        # The next job of this trainer starts from it (the ranks' copy: the worker may
        # delete its own).
        shutil.copy(state_path, source / TRAINER_STATE)
        self.adapter_dir = source
        self._record("saved", step=self.step)

    def release(self) -> None:
        """Stop the ranks of a job still running (a failed or cancelled job)."""
        if self.released:
            return
        self.released = True
        if self._process is not None and self._process.poll() is None:
            self._process.stop(grace_s=STOP_TIMEOUT_S)
        self._record("released")

    def offload(self) -> None:
        """Nothing to move: between jobs the ranks hold no memory."""

    def reload(self) -> None:
        """Nothing to move back (``offload``)."""


def _resumed(plan: ShardedPlan, directory: Path) -> None:
    """A resumed plan knows where it stopped before the ranks start, as a resumed in-process
    plan does (the worker reports the job resumed, not started); the ranks check the rest."""
    import torch

    path = directory / PROGRESS
    if not path.is_file():
        raise TrainingError(f"the saved state holds no {PROGRESS}: it is not a job's saved state")
    state = torch.load(path, map_location="cpu", weights_only=True)
    plan.num_gradient_steps, plan.steps_done = int(state["num_steps"]), int(state["steps_done"])
    plan.step_metrics = list(state["metrics"])
    plan.summary, plan.warning = dict(state["summary"]), state["warning"]
    plan.agreement_pending = False


def _apply(plan: ShardedPlan, event: RankEvent) -> None:
    if event["event"] == "prepared":
        prepared = event["plan"]
        plan.num_gradient_steps = prepared["num_gradient_steps"]
        plan.steps_done = prepared["steps_done"]
        plan.summary, plan.warning = prepared["summary"], prepared["warning"]
    elif event["event"] == "step":
        plan.steps_done = event["steps_done"]
        plan.step_metrics.append(event["metrics"])
        plan.summary, plan.warning = event["summary"], event["warning"]
        plan.agreement_pending = False
    elif event["event"] in ("saved", "stopped"):
        plan.summary = event.get("summary", plan.summary)


def worker_rendezvous(env: Mapping[str, str], *, trainer_shards: int) -> Rendezvous:
    """The head worker's rendezvous for ``trainer_shards`` ranks over the nodes SkyPilot's
    environment names (one node without it), the same number on each."""
    nodes = Rendezvous.from_skypilot(env, gpus_per_node=1).nodes
    if trainer_shards % nodes:
        raise ConfigurationError(
            f"{trainer_shards} trainer processes (SKYTRAIN_TRAINER_SHARDS) do not split over "
            f"{nodes} nodes: give a multiple of the nodes"
        )
    rendezvous = Rendezvous.from_skypilot(env, gpus_per_node=trainer_shards // nodes)
    if rendezvous.node_rank != 0:
        raise ConfigurationError(
            "the worker runs on the head node (SKYPILOT_NODE_RANK 0); other nodes run "
            "`python -m skytrain_backend.worker.follower`"
        )
    return rendezvous


def sharded_trainer(
    options: Any,
    model_id: str,
    model_config: ModelConfig,
    adapter_dir: Path | None,
    *,
    env: Mapping[str, str] | None = None,
) -> Trainer:
    """The worker's trainer for ``model_id`` when its plan shards it (``AgentOptions``):
    ``trainer_shards`` processes over this node and the followers of the task's other nodes
    (``env``: SkyPilot's, default this process's), or one process under the Unsloth
    trainer's interpreter (``trainer_python``). It answers the calls the job loop makes of a
    ``Trainer``; the loop types it as one."""
    trainer = ShardedTrainer(
        options.base_model,
        model_config=model_config,
        adapter_dir=adapter_dir,
        rendezvous=worker_rendezvous(
            os.environ if env is None else env, trainer_shards=options.trainer_shards
        ),
        work_dir=options.work_dir / "sharded" / model_id,
        # Each rank takes its own GPU (LOCAL_RANK); only a CPU device is passed on.
        device="cpu" if options.device == "cpu" else None,
        options=options.trainer_options,
        python=getattr(options, "trainer_python", None),
    )
    return cast("Trainer", trainer)
