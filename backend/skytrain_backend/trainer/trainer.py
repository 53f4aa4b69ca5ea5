"""The training loop: a batch of scored groups (or SFT trajectories) to optimizer steps.

``Trainer.train_rl`` does all the data work up front (advantages, tokenization, packing), so
the number of optimizer steps and what was skipped are known before the first step; iterating
the returned run performs the steps one by one and yields each step's metrics, which the worker
streams as events.
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

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
    clipped_fractions,
    importance_log_ratio,
    kl_penalty,
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
# Tokens per output-layer chunk where the job's config has no say (SFT, agreement checks).
LOGPROB_CHUNK_SIZE = 1024

Metrics = dict[str, float]


class TrainingRun:
    """The optimizer steps of one training job, performed as it is iterated (once).

    ``steps`` may be made as they are reached (SFT makes each epoch's when it starts), so a
    long run holds one step's data at a time; ``num_gradient_steps`` is known up front.
    """

    def __init__(
        self,
        steps: Iterable[Callable[[], Metrics]],
        *,
        num_gradient_steps: int,
        summary: Metrics,
        on_finished: Callable[[], None],
        device: torch.device | None = None,
        on_step: Callable[[Metrics], None] = lambda metrics: None,
    ) -> None:
        self._steps = steps
        self.num_gradient_steps = num_gradient_steps
        self.summary = summary
        self._on_finished = on_finished
        self._device = device or torch.device("cpu")
        self._on_step = on_step
        self._started = False

    def __iter__(self) -> Iterator[Metrics]:
        if self._started:
            raise RuntimeError("a TrainingRun performs its steps once; start a new run")
        self._started = True
        for number, step in enumerate(self._steps, start=1):
            with out_of_memory_as_error(f"training step {number}", self._device):
                metrics = step()
            self._on_step(metrics)
            yield metrics
        self._on_finished()


def _site_values(
    packing: Packing, row: PackedRow, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampling logprobs (N,), advantages (N,) and row-local sequence ids (N,) of a row."""
    sequences = [packing.sequences[index] for index in row.sequence_indices]
    old_logprobs = torch.tensor(
        [s.logprobs[token] for s, token in zip(sequences, row.token_indices, strict=True)],
        dtype=torch.float32,
        device=device,
    )
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32, device=device)
    sequence_ids = torch.unique(
        torch.tensor(row.sequence_indices, device=device), return_inverse=True
    )[1]
    return old_logprobs, advantages, sequence_ids


class Trainer:
    """A policy (base model + LoRA adapter), its optimizer, and the checkpoint step it is at."""

    def __init__(
        self, policy: Policy, *, base_model: str, model_config: ModelConfig, step: int = 0
    ) -> None:
        self.policy = policy
        self.base_model = base_model
        self.model_config = model_config
        self.step = step
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
    ) -> Trainer:
        """The base model with a fresh adapter (step 0), or a checkpoint directory's adapter.

        A checkpoint directory also restores the optimizer state and step, so training resumes
        exactly where the worker that wrote it stopped. A row whose activations would not fit
        ``activation_memory_limit_bytes`` (default: on CUDA, the memory free then; on CPU, no
        limit) fails its step with ``OutOfMemory`` (``trainer.memory``).
        """
        torch_device = torch.device(device) if device else default_device()
        with out_of_memory_as_error(f"loading {base_model}", torch_device):
            policy = Policy.load(base_model, model_config=model_config, device=torch_device)
            trainer = cls(policy, base_model=base_model, model_config=model_config)
            if adapter_dir is not None:
                trainer._restore(Path(adapter_dir))
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

    def _restore(self, directory: Path) -> None:
        self.policy.load_adapter(directory, model_config=self.model_config)
        state_path = directory / TRAINER_STATE
        if state_path.is_file():
            self.step = int(json.loads(state_path.read_text()).get("step", 0))
        optimizer_path = directory / OPTIMIZER_STATE
        if optimizer_path.is_file():
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
        if self.policy.supports_packed_rows:
            return pack_sequences(sequences, row_length=row_length)
        return one_sequence_per_row(sequences, row_length=row_length)

    def _finish_step(self) -> None:
        self.step += 1

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

    # --- RL ----------------------------------------------------------------------------------

    def train_rl(self, groups: Sequence[TrajectoryGroup], config: RLTrainConfig) -> TrainingRun:
        """Tokenize and pack ``groups`` now; the returned run performs the optimizer steps.

        Each step takes ``grad_accumulation_sequences`` packed rows (one by default). Groups
        with zero reward variance are skipped; if all are, the run has no steps and iterating
        it still advances ``step`` (the worker commits the next checkpoint all the same).
        """
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
        )
        row_length = config.packed_sequence_length or self.model_config.max_seq_length
        packing = self._pack(batch.sequences, row_length)
        if batch.sequences and not packing.rows:
            raise TrainingError(
                f"every trained token lies beyond {row_length} tokens, so nothing is left to "
                "train on: raise the model's max_seq_length or packed_sequence_length, or send "
                "shorter trajectories"
            )
        per_step = config.grad_accumulation_sequences or 1
        chunks = [packing.rows[i : i + per_step] for i in range(0, len(packing.rows), per_step)]
        steps = [functools.partial(self._rl_step, rows, packing, config) for rows in chunks]
        summary = batch.summary | packing.stats | {"train/num_gradient_steps": float(len(steps))}
        # LoRA dropout draws from torch's global generator: seeded per job and step, a rerun of
        # the same job on a new worker draws the same masks.
        torch.manual_seed(config.seed + self.step)
        return TrainingRun(
            steps,
            num_gradient_steps=len(steps),
            summary=summary,
            on_finished=self._finish_step,
            device=self.policy.device,
            on_step=self._record_step,
        )

    def _rl_step(
        self, rows: Sequence[PackedRow], packing: Packing, config: RLTrainConfig
    ) -> Metrics:
        self.policy.model.train()
        # Gradients left by a step that failed halfway must not leak into this one.
        self.optimizer.zero_grad(set_to_none=True)
        loss_function = policy_loss_function(config.loss_fn)
        epsilon = config.epsilon
        epsilon_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
        chunk_size = config.logprob_calculation_chunk_size
        num_tokens = sum(row.num_sites for row in rows)
        totals: defaultdict[str, float] = defaultdict(float)
        for row in rows:
            logprobs, entropy = self.policy.site_logprobs(row, chunk_size=chunk_size)
            old_logprobs, advantages, sequence_ids = _site_values(packing, row, self.policy.device)
            # Tokens without a sampling logprob are taken as on-policy: ratio 1.
            old_logprobs = torch.where(old_logprobs.isnan(), logprobs.detach(), old_logprobs)
            log_ratio = importance_log_ratio(
                logprobs, old_logprobs, sequence_ids, level=config.importance_sampling_level
            )
            per_token = loss_function(
                log_ratio, logprobs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
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
                log_ratio, advantages, epsilon=epsilon, epsilon_high=epsilon_high
            )
            totals["clip_ratio/low"] += float(low.sum())
            totals["clip_ratio/high"] += float(high.sum())
            totals["entropy"] += float(entropy.sum())
            totals["ratio/mean"] += float(torch.exp(log_ratio.detach()).sum())
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
            "train/num_sequences": float(len({i for row in rows for i in row.sequence_indices})),
        }

    # --- SFT ---------------------------------------------------------------------------------

    def train_sft(self, trajectories: Sequence[Trajectory], config: SFTTrainConfig) -> TrainingRun:
        """Supervised fine-tuning on the assistant turns (all, or the last) of trajectories.

        Each epoch shuffles the trajectories (seeded) and takes ``batch_size`` of them per
        optimizer step (8 when unset). ``learning_rate`` is one number or one per step. A step's
        batch is made and packed when the step runs, so the run holds one step's data however
        many epochs it has; trajectories with nothing to learn within ``max_seq_length`` are
        left out of the batches.

        TRL's SFTTrainer is not used: its assistant-only loss needs ``{% generation %}`` markers
        in the chat template, which real templates lack, it would re-tokenize sampled turns
        from text, and it owns the loop and optimizer, where the worker needs per-step metrics
        and an optimizer state shared with RL checkpoints. The splice tokenizer and loop here
        already do both jobs.
        """
        self._check_not_released()
        if not trajectories:
            raise TrainingError("no trajectories to train on: send at least one")
        sequences = tokenize_sft_trajectories(
            self.policy.tokenizer, trajectories, assistant_turns=config.assistant_turns
        )
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

        def steps() -> Iterator[Callable[[], Metrics]]:
            """Each epoch's batches, shuffled (seeded) when the epoch starts."""
            order = random.Random(config.seed)
            rates = iter(learning_rates)
            for _ in range(config.num_epochs):
                indices = list(learnable)
                order.shuffle(indices)
                for start in range(0, len(indices), batch_size):
                    batch = [
                        s for i in indices[start : start + batch_size] for s in by_trajectory[i]
                    ]
                    yield functools.partial(self._sft_step, batch, next(rates), config)

        summary = {
            "trajectories/total": float(len(trajectories)),
            **{key: value * config.num_epochs for key, value in per_epoch.items()},
            "train/num_gradient_steps": float(num_steps),
        }
        torch.manual_seed(config.seed + self.step)
        return TrainingRun(
            steps(),
            num_gradient_steps=num_steps,
            summary=summary,
            on_finished=self._finish_step,
            device=self.policy.device,
            on_step=self._record_step,
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
            learning_rate=learning_rate, weight_decay=0.0, max_grad_norm=config.max_grad_norm
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

    # --- checks ------------------------------------------------------------------------------

    @torch.no_grad()
    def logprob_agreement(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """How far the current policy's logprobs of the sampled tokens are from the engine's.

        With the adapter the engine sampled from, the difference is numerical noise (kernels,
        precision); a large one means the trainer and the engine do not see the same tokens.
        """
        batch = tokenize_rl_groups(
            self.policy.tokenizer,
            groups,
            scale_rewards=False,
            allow_training_without_logprobs=False,
            keep_zero_variance_groups=True,
        )
        packing = self._pack(batch.sequences, self.model_config.max_seq_length)
        self.policy.model.eval()
        differences = []
        for row in packing.rows:
            logprobs, _ = self.policy.site_logprobs(row, chunk_size=LOGPROB_CHUNK_SIZE)
            sampled, _, _ = _site_values(packing, row, self.policy.device)
            known = ~sampled.isnan()
            differences.append((logprobs[known] - sampled[known]).abs())
        difference = torch.cat(differences) if differences else torch.zeros(0)
        if difference.numel() == 0:
            raise TrainingError(
                "no sampled token with a logprob to compare: send choices returned by the "
                "model's endpoint with logprobs"
            )
        return {
            "max_abs_diff": float(difference.max()),
            "mean_abs_diff": float(difference.mean()),
            "num_tokens": float(difference.numel()),
        }
