"""The trainer: a policy and its optimizer, and the loop from a job to optimizer steps.

It reads as two calls::

    plan = trainer.prepare_rl(groups, config)  # or prepare_sft(trajectories, config)
    for metrics in trainer.run(plan):          # one optimizer step per iteration
        ...

``prepare_rl`` does the data work up front: advantages, tokenization on the sampler's own
prompt and sampled ids, the split of the batch into optimizer steps (a property of the job:
``num_gradient_steps`` steps over whole groups, or one per row as ART fills rows; never of how
the trainer lays rows out), ART's loss weights when the job aggregates as ART, and packing, so
the number of steps and what was skipped are known before the first step. ``run`` performs the
steps and yields each one's metrics, which the worker streams as events.

Every trained token also needs the current policy's logprob before any update: it fills in the
logprobs the sampler did not give (or replaces them all, with ``precalculate_logprobs``) and
measures how far the sampler's logprobs are from the trainer's. The first optimizer step's own
forward pass reads them for its rows: no update has happened before it (a step accumulates the
gradient of all its rows, then updates once), so it computes exactly the old policy, and the
job saves a separate pass over those rows. That holds only when the forward pass is
deterministic; with dropout (``Policy.drops_out``), or with ``separate_pass=True``,
``prepare_rl`` reads every row in a pass without gradient, as the rows of the later steps
always are (the policy has moved by the time they run). Until the first step has read its
rows, the plan's agreement metrics and warning are not known (``RLPlan.agreement_pending``).

A plan can stop between two steps and resume elsewhere (a worker yielding to another tenant's
job): ``save_progress`` writes the job's state at that boundary, and ``prepare_rl`` /
``prepare_sft`` with ``resume_from`` make the plan that continues it, so that the adapter a
job ends with does not depend on where it stopped (``progress``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self, Unpack

import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import (
    ModelConfig,
    TrainerEvent,
    TrainerEventData,
    TrainerEventName,
)
from skytrain_backend.trainer import rl, sft
from skytrain_backend.trainer.distributed import SINGLE, Shards
from skytrain_backend.trainer.memory import (
    ActivationBudget,
    ModelShape,
    out_of_memory_as_error,
    release_device_memory,
)
from skytrain_backend.trainer.model import Policy, default_device
from skytrain_backend.trainer.packing import (
    Packing,
    one_sequence_per_row,
    pack_sequences,
)
from skytrain_backend.trainer.plans import (
    OPTIMIZER_STATE,
    TRAINER_STATE,
    Metrics,
    PackingKind,
    RLPlan,
    SFTPlan,
    resolve_gradient_checkpointing,
    row_length_limit,
)
from skytrain_backend.trainer.progress import Progress
from skytrain_backend.trainer.tokenize import (
    TokenizedSequence,
)

__all__ = [
    "OPTIMIZER_STATE",
    "TRAINER_STATE",
    "RLPlan",
    "SFTPlan",
    "Trainer",
    "resolve_gradient_checkpointing",
    "row_length_limit",
]


class Trainer:
    """A policy (base model + LoRA adapter), its optimizer, and the checkpoint step it is at:
    loading, saving, memory, the optimizer step and the loop; the RL and SFT steps are the
    functions of ``rl`` and ``sft`` over it."""

    def __init__(
        self,
        policy: Policy,
        *,
        base_model: str,
        model_config: ModelConfig,
        step: int = 0,
        packing: PackingKind | None = None,
        max_row_tokens: int | None = None,
        shards: Shards = SINGLE,
    ) -> None:
        self.policy = policy
        # This process's rank among the trainer's processes (``distributed``).
        self.shards = shards
        self.base_model = base_model
        self.model_config = model_config
        self.step = step
        # The longest row this trainer runs (the worker's memory plan); None: no limit.
        self.max_row_tokens = max_row_tokens
        self.packing: PackingKind = packing or (
            "shared_prefixes" if policy.supports_packed_rows else "one_per_row"
        )
        if self.packing != "one_per_row" and not policy.supports_packed_rows:
            raise TrainingError(
                f"packing={self.packing!r} needs packed rows, which this model (Unsloth) cannot "
                "run: use packing='one_per_row'"
            )
        # The learning rate and weight decay are set from each job's config before each step.
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=0.0)
        # What happened to this trainer, with Unix times: {"event", "at", ...}. The worker
        # reports it with each job (its timeline: loaded, steps, saved, released).
        self.events: list[TrainerEvent] = []
        self.released = False

    @classmethod
    def load(
        cls,
        base_model: str,
        *,
        model_config: ModelConfig,
        adapter_dir: Path | None = None,
        device: str | None = None,
        activation_memory_limit_bytes: int | None = None,
        packing: PackingKind | None = None,
        fresh_optimizer: bool = False,
        gradient_checkpointing: bool | None = None,
        max_row_tokens: int | None = None,
        spread: bool = False,
        shards: Shards = SINGLE,
    ) -> Self:
        """The base model with a fresh adapter (step 0), or a checkpoint directory's adapter.

        A checkpoint directory also restores the optimizer state and step, so training resumes
        exactly where the worker that wrote it stopped; one without ``optimizer.pt`` is refused
        unless ``fresh_optimizer`` (an adapter made elsewhere, trained on from a fresh state).
        A row whose activations would not fit ``activation_memory_limit_bytes`` (default: on
        CUDA, the memory free then; on CPU, no limit) fails its step with ``OutOfMemory``
        (``trainer.memory``).

        The worker's memory plan comes in as ``gradient_checkpointing`` (for a model config
        that leaves it unset; default: on with CUDA), ``max_row_tokens`` (rows are cut to it,
        ``row_length``) and ``spread`` (the weights over every GPU of the node).

        ``shards``: this process is one of several ranks of one trainer (``distributed``);
        the base model is sharded over them.
        """
        torch_device = torch.device(device) if device else shards.device() or default_device()
        model_config = model_config.model_copy(
            update={
                "gradient_checkpointing": resolve_gradient_checkpointing(
                    model_config.gradient_checkpointing,
                    default=gradient_checkpointing,
                    device=torch_device,
                )
            }
        )
        with out_of_memory_as_error(f"loading {base_model}", torch_device):
            policy = Policy.load(
                base_model,
                model_config=model_config,
                device=torch_device,
                spread=spread,
                shards=shards,
            )
            trainer = cls(
                policy,
                base_model=base_model,
                model_config=model_config,
                packing=packing,
                max_row_tokens=max_row_tokens,
                shards=shards,
            )
            if adapter_dir is not None:
                trainer._restore(Path(adapter_dir), fresh_optimizer=fresh_optimizer)
        policy.budget = ActivationBudget(
            ModelShape.from_config(policy.model.config.to_dict()),
            device=torch_device,
            devices=policy.devices,
            # bf16 weights on CUDA, fp32 on CPU (trainer.model).
            dtype_bytes=2 if torch_device.type == "cuda" else 4,
            gradient_checkpointing=bool(model_config.gradient_checkpointing),
            limit_bytes=activation_memory_limit_bytes,
            lora_rank=model_config.lora_rank,
            lora_modules=tuple(model_config.lora_target_modules),
        )
        trainer._record("loaded", device=str(torch_device), step=trainer.step)
        return trainer

    def _record(self, event: TrainerEventName, **data: Unpack[TrainerEventData]) -> None:
        self.events.append(TrainerEvent(event=event, at=time.time(), **data))

    def _record_step(self, metrics: Metrics) -> None:
        self._record("gradient_step", loss=metrics.get("loss"))

    def release(self) -> None:
        """Free the trainer's memory, on the GPU too; it cannot train or save afterwards.

        The weights move to the meta device (no storage) and the optimizer state is dropped,
        then CUDA's cache is emptied, so an engine waking up next can map that memory again.
        """
        if self.released:
            return
        self.released = True
        self.optimizer.state.clear()
        self.policy.model.to("meta")
        release_device_memory(self.policy.device)
        self._record("released")

    def offload(self) -> None:
        """Move the weights, gradients and optimizer state to host memory, so that an engine
        sharing the GPU can wake; ``reload`` brings them back. Nothing to do on a CPU."""
        if self.policy.device.type != "cpu" and not self.released:
            self._move(torch.device("cpu"))
            release_device_memory(self.policy.device)
            self._record("offloaded")

    def reload(self) -> None:
        """Undo ``offload``: the trainer on its device again, as it was."""
        if self.policy.device.type != "cpu" and not self.released:
            self._move(self.policy.device)
            self._record("reloaded")

    def _move(self, device: torch.device) -> None:
        # Module.to moves each parameter's gradient with it; Adam's moments are moved here
        # (its step count stays a CPU scalar, as torch keeps it).
        self.policy.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device)

    def check_not_released(self) -> None:
        if self.released:
            raise TrainingError("this trainer was released: load it again from its checkpoint")

    def _restore(self, directory: Path, *, fresh_optimizer: bool) -> None:
        self.policy.load_adapter(directory, model_config=self.model_config)
        state_path = directory / TRAINER_STATE
        if state_path.is_file():
            self.step = int(json.loads(state_path.read_text()).get("step", 0))
        optimizer_path = directory / OPTIMIZER_STATE
        if not optimizer_path.is_file():
            if fresh_optimizer:
                return
            raise TrainingError(
                f"the checkpoint at step {self.step} has no {OPTIMIZER_STATE}, so training "
                "cannot resume where it stopped (a fresh optimizer would take a different "
                "step): delete that checkpoint to train on from the one before it"
            )
        self.load_optimizer(optimizer_path)

    def load_optimizer(self, path: Path) -> None:
        """Load the optimizer's state from ``path`` (TrainingError when it does not fit the
        adapter)."""
        state = torch.load(path, map_location=self.policy.device, weights_only=True)
        try:
            self.optimizer.load_state_dict(state)
        except ValueError as exc:
            raise TrainingError(
                f"the optimizer state in {path.name} does not fit this adapter ({exc})"
            ) from exc

    def save(self, directory: Path) -> None:
        """Write a checkpoint directory: the peft adapter, optimizer state and trainer state."""
        self.check_not_released()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.shards.is_main:
            # The adapter and optimizer state are whole and equal on every rank: one writes.
            with out_of_memory_as_error("saving the checkpoint", self.policy.device):
                self.policy.save_adapter(directory)
                torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_STATE)
            state = {
                "step": self.step,
                "base_model": self.base_model,
                "config": self.model_config.model_dump(mode="json"),
            }
            (directory / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        self.shards.barrier()
        self._record("saved", step=self.step)

    def save_progress(self, plan: RLPlan | SFTPlan, directory: Path) -> None:
        """Write the state of a job stopped between two of its steps: a checkpoint directory
        at the job's base step (``save``) plus ``progress.pt`` (``progress``). A trainer
        loaded from it (``Trainer.load(adapter_dir=directory)``) continues the job with
        ``prepare_rl`` / ``prepare_sft(..., resume_from=directory)``."""
        if not 0 < plan.steps_done < plan.num_gradient_steps:
            raise RuntimeError(
                f"a plan is saved between two of its steps, not after {plan.steps_done} of "
                f"{plan.num_gradient_steps}: save() a finished job as a checkpoint"
            )
        if plan.base_step != self.step:
            raise RuntimeError(
                f"the plan was prepared at step {plan.base_step} but the trainer is at step "
                f"{self.step}: only the trainer running a plan can save its progress"
            )
        self.save(directory)
        # Every row of an RL job's steps still to run was read before the first update.
        old_logprobs = rl.remaining_old_logprobs(self, plan) if plan.kind == "rl" else []
        if not self.shards.is_main:
            self.shards.barrier()
            self._record("saved_progress", steps_done=plan.steps_done)
            return
        Progress(
            kind=plan.kind,
            base_step=plan.base_step,
            num_steps=plan.num_gradient_steps,
            position=plan.position,
            summary=plan.summary,
            warning=plan.warning,
            old_logprobs=old_logprobs,
        ).write(Path(directory))
        self.shards.barrier()
        self._record("saved_progress", steps_done=plan.steps_done)

    # --- data --------------------------------------------------------------------------------

    def row_length(self, requested: int) -> int:
        """The row length a job runs at: ``requested``, cut to the longest row of the
        worker's plan and to what the model takes whole (Unsloth's max_seq_length)."""
        return row_length_limit(requested, self.max_row_tokens, self.policy.max_row_tokens)

    @staticmethod
    def shorter_rows_advice(requested: int, row_length: int) -> str:
        if row_length < requested:
            return (
                f"this worker trains rows of at most {row_length} tokens (its memory plan, or "
                "what the model takes whole): send shorter trajectories, or use a worker with "
                "more GPU memory"
            )
        return (
            "raise the model's max_seq_length (or the job's packed_sequence_length), or send "
            "shorter trajectories"
        )

    def pack(self, sequences: Sequence[TokenizedSequence], row_length: int) -> Packing:
        if self.packing == "one_per_row":
            return one_sequence_per_row(sequences, row_length=row_length)
        return pack_sequences(
            sequences, row_length=row_length, share_prefixes=self.packing == "shared_prefixes"
        )

    def check_vocabulary(self, sequences: Sequence[TokenizedSequence]) -> None:
        size = self.policy.vocab_size
        for sequence in sequences:
            bad = [token for token in sequence.token_ids if not 0 <= token < size]
            if bad:
                raise TrainingError(
                    f"trajectory {sequence.trajectory_index} of group {sequence.group_index} has "
                    f"token ids outside this model's vocabulary (0..{size - 1}): {bad[:5]}; was "
                    "it sampled from another base model?"
                )

    @contextlib.contextmanager
    def row_masks(
        self, seed: int, index: int, position: int, *, stream: str = "policy"
    ) -> Iterator[None]:
        """Dropout masks for row ``position`` of gradient step ``index`` drawn from a generator
        of their own, seeded by the job's ``seed``, the model's step, the row and ``stream``
        (the policy's pass, or the base model's reference pass): a row draws the same masks
        whichever rank of a sharded trainer runs it and whatever rows ran before it, so N
        processes make one process's update with dropout too, and a resumed or rerun job draws
        the masks it drew before. The CPU's and this device's generators are put back after
        (a model spread over several GPUs in one process gets the others re-seeded)."""
        if not self.policy.drops_out:
            yield
            return
        device = self.policy.device
        digest = hashlib.blake2b(
            f"{seed}/{self.step}/{index}/{position}/{stream}".encode(), digest_size=8
        ).digest()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(int.from_bytes(digest, "big") >> 1)
            yield

    def optimizer_step(
        self,
        *,
        learning_rate: float,
        weight_decay: float,
        max_grad_norm: float,
        adam_beta2: float = 0.999,
        adam_beta1: float | None = None,
        eps: float | None = None,
    ) -> float:
        """Clip the accumulated gradients to ``max_grad_norm`` and apply them with AdamW
        (``adam_beta1`` and ``eps``: None keeps the optimizer's), then clear them; the
        gradient norm. TrainingError, the gradients dropped, when it is not finite."""
        parameters = self.policy.trainable_parameters()
        # Each rank holds its rows' share of the gradient: the sum is the whole step's.
        self.shards.sum_gradients(parameters)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"the gradient norm is {grad_norm}: the gradients were dropped and the adapter "
                "left unchanged; lower the learning rate or check the batch for extreme "
                "logprobs or advantages"
            )
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
            group["weight_decay"] = weight_decay
            beta1 = group["betas"][0] if adam_beta1 is None else adam_beta1
            group["betas"] = (beta1, adam_beta2)
            if eps is not None:
                group["eps"] = eps
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # --- the jobs: ``rl`` and ``sft`` -------------------------------------------------------

    # The plans of the two job kinds (TrainingError for input they cannot train on): RL's
    # ``reference`` is the KL penalty's reference checkpoint (None: the base model).
    prepare_rl = rl.prepare
    prepare_sft = sft.prepare

    # --- the loop ----------------------------------------------------------------------------

    def run(self, plan: RLPlan | SFTPlan) -> Iterator[Metrics]:
        """Perform the plan's optimizer steps, yielding each one's metrics.

        ``step`` advances by one once the last step is done (also for a plan with no steps,
        when every group had zero reward variance: nothing changes, but the worker still
        commits the next step). A plan runs once, on the trainer that prepared it.
        """
        if plan.started:
            raise RuntimeError("a plan runs once: prepare the job again to train on it again")
        if plan.base_step != self.step:
            raise RuntimeError(
                f"the plan was prepared at step {plan.base_step} but the trainer is at step "
                f"{self.step}: prepare it again"
            )
        self.check_not_released()
        plan.started = True
        position = plan.position
        if position.random_state is None:
            # torch's global generator, seeded per job and step (LoRA dropout draws from a
            # generator per row instead: ``row_masks``).
            torch.manual_seed(plan.config.seed + self.step)
        else:
            # A resumed plan: the generators as its last step done left them.
            position.random_state.restore(self.policy.device)
        steps = rl.pending_steps(self, plan) if plan.kind == "rl" else sft.pending_steps(self, plan)
        for number, step in enumerate(steps, start=position.steps_done + 1):
            with out_of_memory_as_error(f"training step {number}", self.policy.device):
                metrics = step()
            position.advance(metrics, self.policy.device)
            self._record_step(metrics)
            yield metrics
        self.step += 1
