"""GRPO on a ``Trainer``: ``prepare`` (tokenize, split into steps, pack, read the old
logprobs) makes an ``RLPlan``; ``pending_steps`` gives the plan's optimizer steps still to run
(``train_step`` each, after ART's warm-up step where the job asks for it); ``Trainer.run``
runs them."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from skytrain_backend.errors import InvalidRequest, TrainingError
from skytrain_backend.protocol import (
    RLTrainConfig,
    TrajectoryGroup,
    check_trainable,
    off_policy_steps,
    within_off_policy,
)
from skytrain_backend.trainer.loss import (
    art_kl_advantages,
    capped_ratio,
    clipped_fractions,
    importance_ratio,
    kimi_k2_advantages,
    kl_penalty,
    masked_ratio,
    policy_loss_function,
    token_mean,
    truncated_importance_weights,
)
from skytrain_backend.trainer.memory import out_of_memory_as_error
from skytrain_backend.trainer.packing import Packing, merged_stats
from skytrain_backend.trainer.plans import (
    ART_WARMUP_LEARNING_RATE,
    Agreement,
    Metrics,
    RLPlan,
    WarmupRow,
)
from skytrain_backend.trainer.progress import Progress
from skytrain_backend.trainer.rl_rows import (
    apply_art_weights,
    art_row_length,
    row_old_logprobs,
    site_advantages,
    site_sampling_logprobs,
    steps_over_groups,
    steps_per_row,
)
from skytrain_backend.trainer.state import TrainerState
from skytrain_backend.trainer.tokenize import TokenizedSequence, tokenize_rl_groups


def prepare(
    trainer: TrainerState,
    groups: Sequence[TrajectoryGroup],
    config: RLTrainConfig,
    *,
    separate_pass: bool = False,
    resume_from: Path | None = None,
    reference: Path | None = None,
) -> RLPlan:
    """Tokenize, split into steps and pack ``groups``; read the old logprobs of the rows
    that the first step's forward pass will not read, without gradient. Raises
    TrainingError for input it cannot train on.

    The first step reads its own rows' old logprobs unless ``separate_pass`` or the
    policy drops out: then every row is read here, and the agreement metrics and warning
    are in the plan at once (``agreement_pending`` is False).

    ``resume_from``: the directory ``save_progress`` wrote for this job (this trainer
    loaded from it): the plan continues after the steps done there, with the old
    logprobs, summary and metrics saved then (nothing is read again).

    ``reference``: the checkpoint directory of the KL penalty's reference policy (the
    config's ``kl_penalty_reference_step`` / ``kl_penalty_step_lag``, fetched by the
    worker), loaded as a second adapter; None: the base model is the reference."""
    trainer.check_not_released()
    policy_loss_function(config.loss_fn)  # an unknown loss fails before any work
    # max_off_policy_steps against the step this job trains from: the API checked it against
    # the model's step when the job was queued, and a job queued behind others starts further
    # behind. Groups now too old are left out and counted, as ART's pipeline discards stale
    # groups (TrainingError when none is left).
    groups, refused = within_off_policy(
        groups, base_step=trainer.step, limit=config.max_off_policy_steps
    )
    try:
        check_trainable(
            list(groups),
            allow_training_without_logprobs=config.allow_training_without_logprobs,
        )
    except InvalidRequest as exc:
        raise TrainingError(exc.message) from exc
    art = config.aggregation == "art"
    batch = tokenize_rl_groups(
        trainer.policy.tokenizer,
        groups,
        scale_rewards=config.scale_rewards,
        allow_training_without_logprobs=config.allow_training_without_logprobs,
        advantage_balance=config.advantage_balance,
        art_rules=art,
    )
    trainer.check_vocabulary(batch.sequences)
    trainer.policy.set_reference(
        reference if config.kl_penalty_coef > 0 else None,
        model_config=trainer.model_config,
        name=f"the KL reference checkpoint (step {config.kl_reference_step(trainer.step)})",
    )
    seed = config.seed + trainer.step
    num_steps = config.num_gradient_steps
    if isinstance(num_steps, int):
        requested = config.packed_sequence_length or trainer.model_config.max_seq_length
        row_length = trainer.row_length(requested)
        by_group: defaultdict[int, list[TokenizedSequence]] = defaultdict(list)
        for sequence in batch.sequences:
            by_group[sequence.group_index].append(sequence)
        parts = [
            [s for g in sorted(part) for s in by_group[g]]
            for part in steps_over_groups(sorted(by_group), num_steps, seed=seed)
        ]
        rate_counts, dropped, warmup_cut = None, {}, None
    else:  # "per_row"
        requested = config.packed_sequence_length or art_row_length(
            batch.sequences, max_seq_length=trainer.model_config.max_seq_length
        )
        row_length = trainer.row_length(requested)
        art_steps = steps_per_row(batch.sequences, row_length)
        parts, rate_counts, dropped = art_steps.parts, art_steps.trajectories, art_steps.summary
        warmup_cut = art_steps.warmup if config.warmup_step else None
    packings = [trainer.pack(part, row_length) for part in parts]
    kept = [index for index, packing in enumerate(packings) if packing.rows]
    steps = [packings[index] for index in kept]
    if rate_counts is not None:
        rate_counts = [rate_counts[index] for index in kept]
    if batch.sequences and not steps:
        raise TrainingError(
            f"every trained token lies beyond {row_length} tokens, so nothing is left to "
            f"train on: {trainer.shorter_rows_advice(requested, row_length)}"
        )
    if art:
        apply_art_weights(steps, batch.sequences)
    # Cut after the weights are set: the copies keep them.
    warmup = None
    if warmup_cut is not None and steps:
        cut, count = warmup_cut
        cut_sequences = [batch.sequences[index].truncated(tokens) for index, tokens in cut]
        warmup = WarmupRow(trainer.pack(cut_sequences, row_length), count)
    # Groups sampled from an older step are trained with their own sampled logprobs as the
    # old policy (the ratio and clipping cover the lag); the job reports how far behind.
    summary = (
        batch.summary
        | dropped
        | merged_stats(packings, row_length=row_length)
        | {"train/num_gradient_steps": float(len(steps))}
        | off_policy_steps(groups, base_step=trainer.step)
    )
    if config.max_off_policy_steps is not None:
        summary["groups/refused_off_policy"] = float(len(refused))
    if resume_from is not None:
        return _resumed_plan(trainer, config, steps, summary, Path(resume_from), rate_counts)
    # Dropout would make the first step's forward pass differ from the old policy's; ART's
    # KL from the sampler needs every old logprob before its step.
    art_kl_from_sample = config.kl_penalty_coef > 0 and config.kl_penalty_source == "sample"
    first_step_reads = (
        bool(steps)
        and not separate_pass
        and not trainer.policy.drops_out
        and not art_kl_from_sample
    )
    agreement = Agreement()
    with out_of_memory_as_error("computing the old logprobs", trainer.policy.device):
        old_logprobs = _old_logprobs(
            trainer, steps[1:] if first_step_reads else steps, config, agreement
        )
    plan = RLPlan(
        config=config,
        steps=steps,
        old_logprobs=old_logprobs,
        summary=summary,
        base_step=trainer.step,
        rate_counts=rate_counts,
        warmup=warmup,
    )
    if first_step_reads:
        plan.old_logprobs.insert(0, [None] * len(steps[0].rows))
        plan.agreement = agreement
    else:
        _finish_agreement(trainer, plan, agreement)
    return plan


def _resumed_plan(
    trainer: TrainerState,
    config: RLTrainConfig,
    steps: list[Packing],
    summary: Metrics,
    directory: Path,
    rate_counts: list[int] | None,
) -> RLPlan:
    progress = Progress.read(directory, kind="rl", base_step=trainer.step, num_steps=len(steps))
    done = progress.position.steps_done
    saved_rows = [len(rows) for rows in progress.old_logprobs]
    if saved_rows != [len(packing.rows) for packing in steps[done:]]:
        raise TrainingError(
            f"the saved state in {directory} has rows {saved_rows} for the steps after "
            f"step {done}, but this job packs {[len(p.rows) for p in steps[done:]]}: it was "
            "saved by another job, or by a trainer that packs differently"
        )
    device = trainer.policy.device
    old_logprobs: list[list[torch.Tensor | None]] = [
        [None] * len(packing.rows) for packing in steps[:done]
    ]
    old_logprobs += [[row.to(device) for row in rows] for rows in progress.old_logprobs]
    return RLPlan(
        config=config,
        steps=steps,
        old_logprobs=old_logprobs,
        summary=summary | progress.summary,
        base_step=trainer.step,
        warning=progress.warning,
        position=progress.position,
        rate_counts=rate_counts,
    )


@torch.no_grad()
def _old_logprobs(
    trainer: TrainerState, steps: Sequence[Packing], config: RLTrainConfig, agreement: Agreement
) -> list[list[torch.Tensor | None]]:
    """The old logprobs of every row of ``steps``, read in a pass without gradient."""
    trainer.policy.model.eval()
    old: list[list[torch.Tensor | None]] = []
    for packing in steps:
        # Each rank reads its own rows (``distributed``): the others stay None there.
        old.append([None] * len(packing.rows))
        for position, row, scale in trainer.shards.rows(packing.rows):
            current, _ = trainer.policy.site_logprobs(
                row, chunk_size=config.logprob_calculation_chunk_size
            )
            if scale:
                old[-1][position] = row_old_logprobs(packing, row, current, config, agreement)
    return old


def _finish_agreement(trainer: TrainerState, plan: RLPlan, agreement: Agreement) -> None:
    if trainer.shards.sharded:
        parts = trainer.shards.gather(([d.cpu() for d in agreement.differences], agreement.missing))
        agreement = Agreement(
            differences=[d for differences, _ in parts for d in differences],
            missing=sum(missing for _, missing in parts),
        )
    measured, plan.warning = agreement.result(trainer.policy.model.dtype)
    plan.summary |= measured
    plan.agreement = None


def pending_steps(trainer: TrainerState, plan: RLPlan) -> Iterator[Callable[[], Metrics]]:
    """The plan's steps not done yet, ART's warm-up step first where it is due."""
    with out_of_memory_as_error("ART's warm-up step", trainer.policy.device):
        art_warmup(trainer, plan)
    for index in range(plan.steps_done, plan.num_gradient_steps):
        yield functools.partial(train_step, trainer, plan, index)


def remaining_old_logprobs(trainer: TrainerState, plan: RLPlan) -> list[list[torch.Tensor]]:
    """The old logprobs of every row of the steps still to run, on the CPU, for the job's
    saved progress: each rank read its own rows before the first update, so the ranks'
    parts are gathered (every rank gets them all)."""
    mine = {
        (step, position): row.cpu()
        for step, rows in enumerate(plan.old_logprobs[plan.steps_done :])
        for position, row in enumerate(rows)
        if row is not None
    }
    read: dict[tuple[int, int], torch.Tensor] = {}
    for part in trainer.shards.gather(mine):
        read |= part
    return [
        [read[step, position] for position in range(len(rows))]
        for step, rows in enumerate(plan.old_logprobs[plan.steps_done :])
    ]


def art_warmup(trainer: TrainerState, plan: RLPlan) -> None:
    """ART's warm-up step (``warmup_step``), taken once by a trainer whose optimizer has
    no state yet, before the plan's first step: the first row cut to ART's warm-up
    length, at learning rate 1e-9 times its rate multiplier, without a KL penalty, the
    sampler's logprobs as the old ones. The update is negligible; AdamW's moments and
    step count are what it sets, as ART's fresh trainer has them."""
    if plan.warmup is None or plan.steps_done or trainer.optimizer.state:
        return
    config = plan.config.model_copy(
        update={
            "learning_rate": ART_WARMUP_LEARNING_RATE,
            "kl_penalty_coef": 0.0,
            "precalculate_logprobs": False,
            "truncated_importance_sampling": None,
        }
    )
    rows = plan.warmup.packing.rows
    warmup = RLPlan(
        config=config,
        steps=[plan.warmup.packing],
        old_logprobs=[[None] * len(rows)],
        summary={},
        base_step=trainer.step,
        rate_counts=[plan.warmup.rate_count],
    )
    warmup.agreement = Agreement()
    train_step(trainer, warmup, 0)


def train_step(trainer: TrainerState, plan: RLPlan, index: int) -> Metrics:
    config, packing = plan.config, plan.steps[index]
    trainer.policy.model.train()
    # Gradients left by a step that failed halfway must not leak into this one.
    trainer.optimizer.zero_grad(set_to_none=True)
    loss_function = policy_loss_function(config.loss_fn)
    epsilon, epsilon_high = config.clip_range()
    chunk_size = config.logprob_calculation_chunk_size
    num_tokens = sum(row.num_sites for row in packing.rows)
    totals: defaultdict[str, float] = defaultdict(float)
    step_old_logprobs = plan.old_logprobs[index]
    art_kl = config.kl_penalty_coef > 0 and config.kl_penalty_source is not None
    references, mean_kl = (
        _art_kl_inputs(trainer, packing, index, step_old_logprobs, config) if art_kl else ({}, 0.0)
    )
    # This rank's rows (all of them in one process); ``scale`` 0: a padding row, run so
    # that every rank runs as many passes, that counts for nothing (``distributed``).
    for position, row, scale in trainer.shards.rows(packing.rows):
        with trainer.row_masks(config.seed, index, position):
            logprobs, entropy = trainer.policy.site_logprobs(row, chunk_size=chunk_size)
        old_logprobs = step_old_logprobs[position]
        if old_logprobs is None and not scale:
            old_logprobs = logprobs.detach()
        elif old_logprobs is None:
            # The first step: no update has happened yet (the step updates once, after all
            # its rows), so this forward pass computes the old policy's logprobs.
            assert plan.agreement is not None
            old_logprobs = row_old_logprobs(packing, row, logprobs.detach(), config, plan.agreement)
            step_old_logprobs[position] = old_logprobs
        if _unsampled_ratio_one(config):
            unsampled = site_sampling_logprobs(packing, row, logprobs.device).isnan()
            old_logprobs = torch.where(unsampled, logprobs.detach(), old_logprobs)
        advantages, weights, sequence_ids = site_advantages(packing, row, trainer.policy.device)
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
        if art_kl:
            source = old_logprobs if config.kl_penalty_source == "sample" else logprobs
            advantages = art_kl_advantages(
                advantages,
                source,
                references[position],
                mean_kl=mean_kl,
                coef=config.kl_penalty_coef,
            )
        per_token = loss_function(
            ratio, logprobs, advantages, epsilon=epsilon, epsilon_high=epsilon_high
        )
        if config.truncated_importance_sampling and config.precalculate_logprobs:
            per_token = per_token * truncated_importance_weights(
                old_logprobs,
                site_sampling_logprobs(packing, row, logprobs.device),
                logprobs.detach(),
                cap=config.truncated_importance_sampling,
            )
        totals["loss/policy"] += scale * float((per_token * weights).detach().sum())
        if config.kl_penalty_coef > 0 and not art_kl:
            with (
                torch.no_grad(),
                trainer.policy.reference(),
                trainer.row_masks(config.seed, index, position, stream="reference"),
            ):
                reference, _ = trainer.policy.site_logprobs(row, chunk_size=chunk_size)
            kl = kl_penalty(logprobs, reference)
            per_token = per_token + config.kl_penalty_coef * kl
            totals["loss/kl"] += scale * float(kl.detach().sum())
        (token_mean(per_token, num_tokens, weights) * scale).backward()
        low, high = clipped_fractions(ratio, advantages, epsilon=epsilon, epsilon_high=epsilon_high)
        totals["clip_ratio/low"] += scale * float(low.sum())
        totals["clip_ratio/high"] += scale * float(high.sum())
        totals["entropy"] += scale * float(entropy.sum())
        totals["ratio/mean"] += scale * float(ratio.detach().sum())
    totals = defaultdict(float, trainer.shards.sum(dict(totals)))
    if plan.agreement is not None:
        _finish_agreement(trainer, plan, plan.agreement)
    learning_rate = config.learning_rate * plan.learning_rate_multiplier(index)
    grad_norm = trainer.optimizer_step(
        learning_rate=learning_rate,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        adam_beta2=config.adam_beta2,
    )
    metrics = {key: value / max(num_tokens, 1) for key, value in totals.items()}
    metrics["loss"] = metrics["loss/policy"] + config.kl_penalty_coef * metrics.get("loss/kl", 0.0)
    if art_kl:
        metrics["kl/policy_ref"] = mean_kl
    return metrics | {
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
        "train/num_trainable_tokens": float(num_tokens),
        "train/num_sequences": float(len(packing.sequences)),
    }


def _unsampled_ratio_one(config: RLTrainConfig) -> bool:
    """Whether tokens without a sampler logprob take each step's own logprob as old (ratio
    1 on every step, and the KL penalty's ``"sample"`` source there), as ART does."""
    return config.unsampled_old_logprobs == "current" and not config.precalculate_logprobs


@torch.no_grad()
def _art_kl_inputs(
    trainer: TrainerState,
    packing: Packing,
    index: int,
    old_logprobs: Sequence[torch.Tensor | None],
    config: RLTrainConfig,
) -> tuple[dict[int, torch.Tensor], float]:
    """The reference (``Policy.reference``: the base model or the job's reference checkpoint)
    logprobs of each row of a step, and the mean over the
    step's tokens of the KL ART shapes advantages with: log pi_source - log pi_ref, the
    source being the sampler (the old logprobs, all read before the step for this; where the
    sampler gave none and ``_unsampled_ratio_one``, the current policy's, as the step takes
    them as old) or the current policy (read here, as the step's own forward pass will compute it). Each rank
    reads its own rows (by position); the mean is over every rank's."""
    chunk_size = config.logprob_calculation_chunk_size
    references: dict[int, torch.Tensor] = {}
    total, count = 0.0, 0
    for position, row, scale in trainer.shards.rows(packing.rows):
        with (
            trainer.policy.reference(),
            trainer.row_masks(config.seed, index, position, stream="reference"),
        ):
            reference, _ = trainer.policy.site_logprobs(row, chunk_size=chunk_size)
        old = old_logprobs[position]
        if config.kl_penalty_source == "sample":
            assert old is not None or not scale, "prepare_rl reads the old logprobs for this"
            source = old if old is not None else reference
            unsampled = site_sampling_logprobs(packing, row, reference.device).isnan()
            if _unsampled_ratio_one(config) and bool(unsampled.any()):
                # Their old logprob is the step's own (``train_step``), here as there.
                with trainer.row_masks(config.seed, index, position):
                    current, _ = trainer.policy.site_logprobs(row, chunk_size=chunk_size)
                source = torch.where(unsampled, current, source)
        else:
            # With the masks the step's own forward pass of the row draws.
            with trainer.row_masks(config.seed, index, position):
                source, _ = trainer.policy.site_logprobs(row, chunk_size=chunk_size)
        references.setdefault(position, reference)
        total += scale * float((source - reference).sum())
        count += int(scale) * row.num_sites
    summed = trainer.shards.sum({"total": total, "count": float(count)})
    return references, summed["total"] / max(summed["count"], 1)
