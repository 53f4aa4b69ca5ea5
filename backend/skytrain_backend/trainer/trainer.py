"""The training loop: a batch of scored groups (or SFT trajectories) to optimizer steps.

It reads as two calls::

    plan = trainer.prepare_rl(groups, config)  # or prepare_sft(trajectories, config)
    for metrics in trainer.run(plan):          # one optimizer step per iteration
        ...

``prepare_rl`` does the data work up front: advantages, tokenization on the sampler's own
prompt and sampled ids, the split of the groups into optimizer steps (a property of the job:
``num_gradient_steps`` steps over whole groups, never of how rows are packed), and packing, so
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
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from skytrain_backend.errors import InvalidRequest, TrainingError
from skytrain_backend.protocol import (
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
    check_trainable,
)
from skytrain_backend.trainer.loss import (
    capped_ratio,
    clipped_fractions,
    importance_ratio,
    kimi_k2_advantages,
    kl_penalty,
    masked_ratio,
    policy_loss_function,
    token_mean,
)
from skytrain_backend.trainer.memory import (
    ActivationBudget,
    ModelShape,
    out_of_memory_as_error,
    release_device_memory,
)
from skytrain_backend.trainer.model import Policy, default_device
from skytrain_backend.trainer.packing import (
    PackedRow,
    Packing,
    merged_stats,
    one_sequence_per_row,
    pack_sequences,
)
from skytrain_backend.trainer.tokenize import (
    TokenizedSequence,
    tokenize_rl_groups,
    tokenize_sft_trajectories,
)

OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
# SFTTrainConfig.batch_size=None: trajectories per optimizer step.
DEFAULT_SFT_BATCH_SIZE = 8
# Tokens per output-layer chunk where the job's config has no say (SFT).
LOGPROB_CHUNK_SIZE = 1024
# How far the trainer's mean logprob of the sampled tokens may be from the sampler's before a
# job says so: numerical noise in fp32 is far below the first, in bf16 below the second.
AGREEMENT_NOISE = {torch.float32: 1e-3, torch.float64: 1e-3}
AGREEMENT_NOISE_HALF = 5e-2

Metrics = dict[str, float]
# How rows are built: each group's prompt shared by its completions (the default where the
# model can run packed rows), rows packed without sharing, or one sequence per row (Unsloth's
# path). None of them changes what a job computes, only how fast.
PackingKind = Literal["shared_prefixes", "packed", "one_per_row"]


@dataclass
class _Agreement:
    """Sampler-vs-trainer logprob differences of the rows read so far."""

    differences: list[torch.Tensor] = field(default_factory=list)
    missing: int = 0

    def add(self, current: torch.Tensor, sampled: torch.Tensor) -> None:
        known = ~sampled.isnan()
        self.missing += int((~known).sum())
        self.differences.append((current[known] - sampled[known]).abs())

    def result(self, dtype: torch.dtype) -> tuple[Metrics, str | None]:
        """The agreement metrics, and a warning when they are far beyond ``dtype`` noise."""
        metrics = {"tokens/without_sampling_logprob": float(self.missing)}
        difference = torch.cat(self.differences) if self.differences else torch.zeros(0)
        if difference.numel() == 0:
            return metrics, None
        mean, largest = float(difference.mean()), float(difference.max())
        metrics |= {
            "logprob_agreement/mean_abs_diff": mean,
            "logprob_agreement/max_abs_diff": largest,
            "logprob_agreement/num_tokens": float(difference.numel()),
        }
        noise = AGREEMENT_NOISE.get(dtype, AGREEMENT_NOISE_HALF)
        if mean <= noise:
            return metrics, None
        return metrics, (
            f"the trainer's logprobs of the sampled tokens differ from the sampler's by "
            f"{mean:.3g} nats on average (at most {largest:.3g}, over {difference.numel()} "
            f"tokens), far beyond {str(dtype).removeprefix('torch.')} noise (~{noise:g}): "
            "the trainer does not compute what the sampler did (another base model, adapter "
            "or chat template?), so importance ratios and clipping act on wrong values"
        )


@dataclass
class RLPlan:
    """An RL job ready to run: the rows of each optimizer step and what is known of them."""

    config: RLTrainConfig
    steps: list[Packing]
    # Per step, per row: the old logprob of each prediction site (N,), sampler's or trainer's;
    # None for a row of the first step until that step's forward pass has read it.
    old_logprobs: list[list[torch.Tensor | None]]
    summary: Metrics
    base_step: int
    # Set when the sampler's logprobs are far from the trainer's (said in the job's events).
    warning: str | None = None
    started: bool = field(default=False, repr=False)
    # The differences gathered so far while the first step has rows left to read.
    _agreement: _Agreement | None = field(default=None, repr=False)

    @property
    def num_gradient_steps(self) -> int:
        return len(self.steps)

    @property
    def agreement_pending(self) -> bool:
        """True until the first step's forward pass has read the old logprobs of its rows:
        the ``logprob_agreement/*`` metrics and ``warning`` are known only then."""
        return self._agreement is not None


@dataclass
class SFTPlan:
    """An SFT job ready to run: its optimizer steps' batches, made as the run reaches them
    (each epoch's shuffle when it starts), so a long run holds one step's data at a time."""

    config: SFTTrainConfig
    batches: Callable[[], Iterator[tuple[list[TokenizedSequence], float]]]
    num_steps: int
    summary: Metrics
    base_step: int
    # SFT has no sampler to compare with; the field lets the worker treat both plans alike.
    warning: str | None = None
    started: bool = field(default=False, repr=False)

    @property
    def num_gradient_steps(self) -> int:
        return self.num_steps

    @property
    def agreement_pending(self) -> bool:
        """Always False: SFT has no sampler to agree with (the worker treats plans alike)."""
        return False


def _site_sampling_logprobs(packing: Packing, row: PackedRow, device: torch.device) -> torch.Tensor:
    """The sampler's logprob of each prediction site of a row (N,), NaN where unknown."""
    return torch.tensor(
        [
            packing.sequences[s].logprobs[token]
            for s, token in zip(row.sequence_indices, row.token_indices, strict=True)
        ],
        dtype=torch.float32,
        device=device,
    )


def _row_old_logprobs(
    packing: Packing,
    row: PackedRow,
    current: torch.Tensor,
    config: RLTrainConfig,
    agreement: _Agreement,
) -> torch.Tensor:
    """A row's old logprobs (N,): the sampler's where it gave them (unless
    ``precalculate_logprobs``), else ``current``, the policy's before any update. The
    differences between the two go to ``agreement``."""
    sampled = _site_sampling_logprobs(packing, row, current.device)
    agreement.add(current, sampled)
    use_current = torch.ones_like(sampled, dtype=torch.bool)
    if not config.precalculate_logprobs:
        use_current = sampled.isnan()
    return torch.where(use_current, current, sampled)


def _site_advantages(
    packing: Packing, row: PackedRow, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (N,) and row-local sequence ids (N,) of a row's prediction sites."""
    advantages = torch.tensor(
        [packing.sequences[s].advantage for s in row.sequence_indices],
        dtype=torch.float32,
        device=device,
    )
    sequence_ids = torch.unique(
        torch.tensor(row.sequence_indices, device=device), return_inverse=True
    )[1]
    return advantages, sequence_ids


def _steps_over_groups(
    group_indices: Sequence[int], num_steps: int, *, seed: int
) -> list[list[int]]:
    """The groups shuffled (seeded) and split into ``num_steps`` near-equal parts (fewer when
    there are fewer groups: every step trains at least one whole group)."""
    order = list(group_indices)
    random.Random(seed).shuffle(order)
    parts = min(num_steps, len(order))
    return [order[i * len(order) // parts : (i + 1) * len(order) // parts] for i in range(parts)]


class Trainer:
    """A policy (base model + LoRA adapter), its optimizer, and the checkpoint step it is at."""

    def __init__(
        self,
        policy: Policy,
        *,
        base_model: str,
        model_config: ModelConfig,
        step: int = 0,
        packing: PackingKind | None = None,
    ) -> None:
        self.policy = policy
        self.base_model = base_model
        self.model_config = model_config
        self.step = step
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
        self.events: list[dict[str, Any]] = []
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
    ) -> Trainer:
        """The base model with a fresh adapter (step 0), or a checkpoint directory's adapter.

        A checkpoint directory also restores the optimizer state and step, so training resumes
        exactly where the worker that wrote it stopped; one without ``optimizer.pt`` is refused
        unless ``fresh_optimizer`` (an adapter made elsewhere, trained on from a fresh state).
        A row whose activations would not fit ``activation_memory_limit_bytes`` (default: on
        CUDA, the memory free then; on CPU, no limit) fails its step with ``OutOfMemory``
        (``trainer.memory``).
        """
        torch_device = torch.device(device) if device else default_device()
        with out_of_memory_as_error(f"loading {base_model}", torch_device):
            policy = Policy.load(base_model, model_config=model_config, device=torch_device)
            trainer = cls(policy, base_model=base_model, model_config=model_config, packing=packing)
            if adapter_dir is not None:
                trainer._restore(Path(adapter_dir), fresh_optimizer=fresh_optimizer)
        policy.budget = ActivationBudget(
            ModelShape.of(policy.model.config),
            device=torch_device,
            # bf16 weights on CUDA, fp32 on CPU (trainer.model).
            dtype_bytes=2 if torch_device.type == "cuda" else 4,
            gradient_checkpointing=model_config.gradient_checkpointing,
            limit_bytes=activation_memory_limit_bytes,
        )
        trainer._record("loaded", device=str(torch_device), step=trainer.step)
        return trainer

    def _record(self, event: str, **data: Any) -> None:
        self.events.append({"event": event, "at": time.time(), **data})

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

    def _check_not_released(self) -> None:
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
        state = torch.load(optimizer_path, map_location=self.policy.device, weights_only=True)
        try:
            self.optimizer.load_state_dict(state)
        except ValueError as exc:
            raise TrainingError(
                f"the optimizer state in {optimizer_path} does not fit this adapter ({exc})"
            ) from exc

    def save(self, directory: Path) -> None:
        """Write a checkpoint directory: the peft adapter, optimizer state and trainer state."""
        self._check_not_released()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with out_of_memory_as_error("saving the checkpoint", self.policy.device):
            self.policy.save_adapter(directory)
            torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_STATE)
        state = {
            "step": self.step,
            "base_model": self.base_model,
            "config": self.model_config.model_dump(mode="json"),
        }
        (directory / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
        self._record("saved", step=self.step)

    # --- data --------------------------------------------------------------------------------

    def _pack(self, sequences: Sequence[TokenizedSequence], row_length: int) -> Packing:
        if self.packing == "one_per_row":
            return one_sequence_per_row(sequences, row_length=row_length)
        return pack_sequences(
            sequences, row_length=row_length, share_prefixes=self.packing == "shared_prefixes"
        )

    def _check_vocabulary(self, sequences: Sequence[TokenizedSequence]) -> None:
        size = self.policy.vocab_size
        for sequence in sequences:
            bad = [token for token in sequence.token_ids if not 0 <= token < size]
            if bad:
                raise TrainingError(
                    f"trajectory {sequence.trajectory_index} of group {sequence.group_index} has "
                    f"token ids outside this model's vocabulary (0..{size - 1}): {bad[:5]}; was "
                    "it sampled from another base model?"
                )

    def _optimizer_step(
        self, *, learning_rate: float, weight_decay: float, max_grad_norm: float
    ) -> float:
        parameters = self.policy.trainable_parameters()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"the gradient norm is {grad_norm}: the adapter was left unchanged; lower the "
                "learning rate or check the batch for extreme logprobs"
            )
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
            group["weight_decay"] = weight_decay
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

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
        self._check_not_released()
        plan.started = True
        # LoRA dropout draws from torch's global generator: seeded per job and step, a rerun of
        # the same job on a new worker draws the same masks.
        torch.manual_seed(plan.config.seed + self.step)
        for number, step in enumerate(self._steps(plan), start=1):
            with out_of_memory_as_error(f"training step {number}", self.policy.device):
                metrics = step()
            self._record_step(metrics)
            yield metrics
        self.step += 1

    def _steps(self, plan: RLPlan | SFTPlan) -> Iterator[Callable[[], Metrics]]:
        if isinstance(plan, RLPlan):
            for index in range(plan.num_gradient_steps):
                yield functools.partial(self._rl_step, plan, index)
        else:
            for sequences, learning_rate in plan.batches():
                yield functools.partial(self._sft_step, sequences, learning_rate, plan.config)

    # --- RL ----------------------------------------------------------------------------------

    def prepare_rl(
        self,
        groups: Sequence[TrajectoryGroup],
        config: RLTrainConfig,
        *,
        separate_pass: bool = False,
    ) -> RLPlan:
        """Tokenize, split into steps and pack ``groups``; read the old logprobs of the rows
        that the first step's forward pass will not read, without gradient. Raises
        TrainingError for input it cannot train on.

        The first step reads its own rows' old logprobs unless ``separate_pass`` or the
        policy drops out: then every row is read here, and the agreement metrics and warning
        are in the plan at once (``agreement_pending`` is False)."""
        self._check_not_released()
        policy_loss_function(config.loss_fn)  # an unknown loss fails before any work
        try:
            check_trainable(
                list(groups),
                allow_training_without_logprobs=config.allow_training_without_logprobs,
            )
        except InvalidRequest as exc:
            raise TrainingError(exc.message) from exc
        batch = tokenize_rl_groups(
            self.policy.tokenizer,
            groups,
            scale_rewards=config.scale_rewards,
            allow_training_without_logprobs=config.allow_training_without_logprobs,
            advantage_balance=config.advantage_balance,
        )
        self._check_vocabulary(batch.sequences)
        row_length = config.packed_sequence_length or self.model_config.max_seq_length
        by_group: defaultdict[int, list[TokenizedSequence]] = defaultdict(list)
        for sequence in batch.sequences:
            by_group[sequence.group_index].append(sequence)
        parts = _steps_over_groups(
            sorted(by_group), config.num_gradient_steps, seed=config.seed + self.step
        )
        packings = [
            self._pack([s for g in sorted(part) for s in by_group[g]], row_length) for part in parts
        ]
        steps = [packing for packing in packings if packing.rows]
        if batch.sequences and not steps:
            raise TrainingError(
                f"every trained token lies beyond {row_length} tokens, so nothing is left to "
                "train on: raise the model's max_seq_length or packed_sequence_length, or send "
                "shorter trajectories"
            )
        # Dropout would make the first step's forward pass differ from the old policy's.
        first_step_reads = bool(steps) and not separate_pass and not self.policy.drops_out
        agreement = _Agreement()
        with out_of_memory_as_error("computing the old logprobs", self.policy.device):
            old_logprobs = self._old_logprobs(
                steps[1:] if first_step_reads else steps, config, agreement
            )
        summary = (
            batch.summary
            | merged_stats(packings, row_length=row_length)
            | {"train/num_gradient_steps": float(len(steps))}
        )
        plan = RLPlan(
            config=config,
            steps=steps,
            old_logprobs=old_logprobs,
            summary=summary,
            base_step=self.step,
        )
        if first_step_reads:
            plan.old_logprobs.insert(0, [None] * len(steps[0].rows))
            plan._agreement = agreement
        else:
            self._finish_agreement(plan, agreement)
        return plan

    @torch.no_grad()
    def _old_logprobs(
        self, steps: Sequence[Packing], config: RLTrainConfig, agreement: _Agreement
    ) -> list[list[torch.Tensor | None]]:
        """The old logprobs of every row of ``steps``, read in a pass without gradient."""
        self.policy.model.eval()
        old: list[list[torch.Tensor | None]] = []
        for packing in steps:
            old.append([])
            for row in packing.rows:
                current, _ = self.policy.site_logprobs(
                    row, chunk_size=config.logprob_calculation_chunk_size
                )
                old[-1].append(_row_old_logprobs(packing, row, current, config, agreement))
        return old

    def _finish_agreement(self, plan: RLPlan, agreement: _Agreement) -> None:
        measured, plan.warning = agreement.result(self.policy.model.dtype)
        plan.summary |= measured
        plan._agreement = None

    def _rl_step(self, plan: RLPlan, index: int) -> Metrics:
        config, packing = plan.config, plan.steps[index]
        self.policy.model.train()
        # Gradients left by a step that failed halfway must not leak into this one.
        self.optimizer.zero_grad(set_to_none=True)
        loss_function = policy_loss_function(config.loss_fn)
        epsilon, epsilon_high = config.clip_range()
        chunk_size = config.logprob_calculation_chunk_size
        num_tokens = sum(row.num_sites for row in packing.rows)
        totals: defaultdict[str, float] = defaultdict(float)
        step_old_logprobs = plan.old_logprobs[index]
        for position, row in enumerate(packing.rows):
            logprobs, entropy = self.policy.site_logprobs(row, chunk_size=chunk_size)
            old_logprobs = step_old_logprobs[position]
            if old_logprobs is None:
                # The first step: no update has happened yet (the step updates once, after all
                # its rows), so this forward pass computes the old policy's logprobs.
                assert plan._agreement is not None
                old_logprobs = _row_old_logprobs(
                    packing, row, logprobs.detach(), config, plan._agreement
                )
                step_old_logprobs[position] = old_logprobs
            advantages, sequence_ids = _site_advantages(packing, row, self.policy.device)
            ratio = importance_ratio(
                logprobs, old_logprobs, sequence_ids, level=config.importance_sampling_level
            )
            ratio = capped_ratio(ratio, config.max_negative_advantage_importance_sampling_weight)
            if config.mask_prob_ratio:
                ratio = masked_ratio(ratio, epsilon=epsilon, epsilon_high=epsilon_high)
            if config.kimi_k2_tau:
                advantages = kimi_k2_advantages(
                    advantages, logprobs, old_logprobs, tau=config.kimi_k2_tau
                )
            per_token = loss_function(
                ratio, logprobs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
            )
            totals["loss/policy"] += float(per_token.detach().sum())
            if config.kl_penalty_coef > 0:
                with torch.no_grad(), self.policy.adapter_disabled():
                    reference, _ = self.policy.site_logprobs(row, chunk_size=chunk_size)
                kl = kl_penalty(logprobs, reference)
                per_token = per_token + config.kl_penalty_coef * kl
                totals["loss/kl"] += float(kl.detach().sum())
            token_mean(per_token, num_tokens).backward()
            low, high = clipped_fractions(
                ratio, advantages, epsilon=epsilon, epsilon_high=epsilon_high
            )
            totals["clip_ratio/low"] += float(low.sum())
            totals["clip_ratio/high"] += float(high.sum())
            totals["entropy"] += float(entropy.sum())
            totals["ratio/mean"] += float(ratio.detach().sum())
        if plan._agreement is not None:
            self._finish_agreement(plan, plan._agreement)
        grad_norm = self._optimizer_step(
            learning_rate=config.learning_rate,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
        )
        metrics = {key: value / max(num_tokens, 1) for key, value in totals.items()}
        metrics["loss"] = metrics["loss/policy"] + config.kl_penalty_coef * metrics.get(
            "loss/kl", 0.0
        )
        return metrics | {
            "grad_norm": grad_norm,
            "learning_rate": config.learning_rate,
            "train/num_trainable_tokens": float(num_tokens),
            "train/num_sequences": float(len(packing.sequences)),
        }

    # --- SFT ---------------------------------------------------------------------------------

    def prepare_sft(self, trajectories: Sequence[Trajectory], config: SFTTrainConfig) -> SFTPlan:
        """Supervised fine-tuning on the assistant turns (all, or the last) of trajectories.

        Each epoch shuffles the trajectories (seeded) and takes ``batch_size`` of them per
        optimizer step (8 when unset). ``learning_rate`` is one number or one per step. A step's
        batch is made and packed when the step runs, so the run holds one step's data however
        many epochs it has; trajectories with nothing to learn within ``max_seq_length`` are
        left out of the batches.

        TRL's SFTTrainer is not used: its assistant-only loss needs ``{% generation %}`` markers
        in the chat template, which real templates lack, it would re-tokenize sampled turns
        from text, and it owns the loop and optimizer, where the worker needs per-step metrics
        and an optimizer state shared with RL checkpoints.
        """
        self._check_not_released()
        if not trajectories:
            raise TrainingError("no trajectories to train on: send at least one")
        sequences = tokenize_sft_trajectories(
            self.policy.tokenizer, trajectories, assistant_turns=config.assistant_turns
        )
        self._check_vocabulary(sequences)
        row_length = self.model_config.max_seq_length
        by_trajectory: defaultdict[int, list[TokenizedSequence]] = defaultdict(list)
        for sequence in sequences:
            by_trajectory[sequence.trajectory_index].append(sequence)
        # Truncation is per sequence: what a trajectory adds to a step is the same in every
        # batch, so it is measured once, and trajectories with nothing to learn within
        # max_seq_length are left out of the batches (every step has data).
        learnable: list[int] = []
        per_epoch: defaultdict[str, float] = defaultdict(float)
        for index in range(len(trajectories)):
            alone = self._pack(by_trajectory[index], row_length)
            if alone.rows:
                learnable.append(index)
            for key in ("sequences/trained", "tokens/trainable", "tokens/truncated"):
                per_epoch[key] += alone.stats[key]
        if not learnable:
            raise TrainingError(
                f"every assistant token lies beyond max_seq_length={row_length}"
                ": raise it or send shorter trajectories"
            )
        batch_size = config.batch_size or DEFAULT_SFT_BATCH_SIZE
        num_steps = math.ceil(len(learnable) / batch_size) * config.num_epochs
        learning_rates = (
            config.learning_rate
            if isinstance(config.learning_rate, list)
            else [config.learning_rate] * num_steps
        )
        if len(learning_rates) != num_steps:
            raise TrainingError(
                f"learning_rate has {len(learning_rates)} values but the job has {num_steps} "
                f"optimizer steps ({config.num_epochs} epochs of {len(learnable)} trajectories "
                f"in batches of {batch_size}): give one value per step or a single number"
            )

        def batches() -> Iterator[tuple[list[TokenizedSequence], float]]:
            """Each epoch's batches, shuffled (seeded) when the epoch starts: a run holds one
            step's data at a time, however many epochs it has."""
            order = random.Random(config.seed)
            rates = iter(learning_rates)
            for _ in range(config.num_epochs):
                indices = list(learnable)
                order.shuffle(indices)
                for start in range(0, len(indices), batch_size):
                    batch = [
                        s for i in indices[start : start + batch_size] for s in by_trajectory[i]
                    ]
                    yield batch, next(rates)

        summary = {
            "trajectories/total": float(len(trajectories)),
            **{key: value * config.num_epochs for key, value in per_epoch.items()},
            "train/num_gradient_steps": float(num_steps),
        }
        return SFTPlan(
            config=config,
            batches=batches,
            num_steps=num_steps,
            summary=summary,
            base_step=self.step,
        )

    def _sft_step(
        self, sequences: list[TokenizedSequence], learning_rate: float, config: SFTTrainConfig
    ) -> Metrics:
        packing = self._pack(sequences, self.model_config.max_seq_length)
        self.policy.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(row.num_sites for row in packing.rows)
        total_loss = total_entropy = 0.0
        for row in packing.rows:
            logprobs, entropy = self.policy.site_logprobs(row, chunk_size=LOGPROB_CHUNK_SIZE)
            loss = token_mean(-logprobs, num_tokens)
            loss.backward()
            total_loss += float(loss.detach())
            total_entropy += float(entropy.sum())
        grad_norm = self._optimizer_step(
            learning_rate=learning_rate,
            weight_decay=0.0,
            max_grad_norm=config.max_grad_norm,
        )
        return {
            "loss": total_loss,
            "loss/sft": total_loss,
            "entropy": total_entropy / max(num_tokens, 1),
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "train/num_trainable_tokens": float(num_tokens),
            "train/num_sequences": float(len(packing.sequences)),
        }
