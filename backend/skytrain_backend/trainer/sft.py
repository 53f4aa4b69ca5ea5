"""Supervised fine-tuning on a ``Trainer``: ``prepare`` makes an ``SFTPlan``,
``pending_steps`` its optimizer steps still to run (``train_step`` each)."""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import (
    SFTTrainConfig,
    Trajectory,
)
from skytrain_backend.trainer.loss import (
    token_mean,
)
from skytrain_backend.trainer.plans import (
    DEFAULT_SFT_BATCH_SIZE,
    LOGPROB_CHUNK_SIZE,
    Metrics,
    SFTPlan,
)
from skytrain_backend.trainer.progress import Position, Progress
from skytrain_backend.trainer.state import TrainerState
from skytrain_backend.trainer.tokenize import (
    TokenizedSequence,
    tokenize_sft_trajectories,
)


def prepare(
    trainer: TrainerState,
    trajectories: Sequence[Trajectory],
    config: SFTTrainConfig,
    *,
    resume_from: Path | None = None,
) -> SFTPlan:
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

    ``resume_from``: the directory ``save_progress`` wrote for this job (this trainer
    loaded from it): the plan continues after the steps done there.
    """
    trainer.check_not_released()
    if not trajectories:
        raise TrainingError("no trajectories to train on: send at least one")
    sequences = tokenize_sft_trajectories(
        trainer.policy.tokenizer, trajectories, assistant_turns=config.assistant_turns
    )
    trainer.check_vocabulary(sequences)
    trainer.policy.set_reference(None, model_config=trainer.model_config)  # an RL job's KL
    requested = trainer.model_config.max_seq_length
    row_length = trainer.row_length(requested)
    by_trajectory: defaultdict[int, list[TokenizedSequence]] = defaultdict(list)
    for sequence in sequences:
        by_trajectory[sequence.trajectory_index].append(sequence)
    # Truncation is per sequence: what a trajectory adds to a step is the same in every
    # batch, so it is measured once, and trajectories with nothing to learn within
    # max_seq_length are left out of the batches (every step has data).
    learnable: list[int] = []
    per_epoch: defaultdict[str, float] = defaultdict(float)
    for index in range(len(trajectories)):
        alone = trainer.pack(by_trajectory[index], row_length)
        if alone.rows:
            learnable.append(index)
        for key in ("sequences/trained", "tokens/trainable", "tokens/truncated"):
            per_epoch[key] += alone.stats[key]
    if not learnable:
        raise TrainingError(
            f"every assistant token lies beyond {row_length} tokens: "
            + trainer.shorter_rows_advice(requested, row_length)
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
                batch = [s for i in indices[start : start + batch_size] for s in by_trajectory[i]]
                yield batch, next(rates)

    summary = {
        "trajectories/total": float(len(trajectories)),
        **{key: value * config.num_epochs for key, value in per_epoch.items()},
        "train/num_gradient_steps": float(num_steps),
    }
    position = Position()
    if resume_from is not None:
        progress = Progress.read(
            Path(resume_from), kind="sft", base_step=trainer.step, num_steps=num_steps
        )
        position, summary = progress.position, summary | progress.summary
    return SFTPlan(
        config=config,
        batches=batches,
        num_steps=num_steps,
        summary=summary,
        base_step=trainer.step,
        position=position,
    )


def pending_steps(trainer: TrainerState, plan: SFTPlan) -> Iterator[Callable[[], Metrics]]:
    """The plan's steps not done yet. The batches of the steps done are made again and
    dropped: each epoch's shuffle draws from one seeded generator, so the later ones depend
    on the earlier ones."""
    batches = itertools.islice(plan.batches(), plan.steps_done, None)
    for index, (sequences, learning_rate) in enumerate(batches, start=plan.steps_done):
        yield functools.partial(train_step, trainer, index, sequences, learning_rate, plan.config)


def train_step(
    trainer: TrainerState,
    index: int,
    sequences: list[TokenizedSequence],
    learning_rate: float,
    config: SFTTrainConfig,
) -> Metrics:
    packing = trainer.pack(sequences, trainer.row_length(trainer.model_config.max_seq_length))
    trainer.policy.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    num_tokens = sum(row.num_sites for row in packing.rows)
    total_loss = total_entropy = 0.0
    # This rank's rows; ``scale`` 0: a padding row (``distributed``).
    for position, row, scale in trainer.shards.rows(packing.rows):
        with trainer.row_masks(config.seed, index, position):
            logprobs, entropy = trainer.policy.site_logprobs(row, chunk_size=LOGPROB_CHUNK_SIZE)
        loss = token_mean(-logprobs, num_tokens) * scale
        loss.backward()
        total_loss += float(loss.detach())
        total_entropy += scale * float(entropy.sum())
    summed = trainer.shards.sum({"loss": total_loss, "entropy": total_entropy})
    total_loss, total_entropy = summed["loss"], summed["entropy"]
    grad_norm = trainer.optimizer_step(
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
