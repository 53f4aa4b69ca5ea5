"""An RL batch as optimizer steps and rows: the split into steps (whole groups, or ART's rows),
ART's loss weights, and what each prediction site of a row carries (the sampler's logprob, the
old logprob, the advantage and weight), read by ``rl``'s steps."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from skytrain_backend.protocol import ART_ROW_MULTIPLE, RLTrainConfig
from skytrain_backend.trainer.advantages import art_weights
from skytrain_backend.trainer.art_layout import art_layout
from skytrain_backend.trainer.packing import PackedRow, Packing
from skytrain_backend.trainer.plans import Agreement, Metrics
from skytrain_backend.trainer.tokenize import TokenizedSequence


def site_sampling_logprobs(packing: Packing, row: PackedRow, device: torch.device) -> torch.Tensor:
    """The sampler's logprob of each prediction site of a row (N,), NaN where unknown."""
    return torch.tensor(
        [
            packing.sequences[s].logprobs[token]
            for s, token in zip(row.sequence_indices, row.token_indices, strict=True)
        ],
        dtype=torch.float32,
        device=device,
    )


def row_old_logprobs(
    packing: Packing,
    row: PackedRow,
    current: torch.Tensor,
    config: RLTrainConfig,
    agreement: Agreement,
) -> torch.Tensor:
    """A row's old logprobs (N,): the sampler's where it gave them (unless
    ``precalculate_logprobs``), else ``current``, the policy's before any update. The
    differences between the two go to ``agreement``."""
    sampled = site_sampling_logprobs(packing, row, current.device)
    agreement.add(current, sampled)
    use_current = torch.ones_like(sampled, dtype=torch.bool)
    if not config.precalculate_logprobs:
        use_current = sampled.isnan()
    return torch.where(use_current, current, sampled)


def site_advantages(
    packing: Packing, row: PackedRow, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages (N,), loss weights (N,) and row-local sequence ids (N,) of a row's
    prediction sites."""
    sequences = [packing.sequences[s] for s in row.sequence_indices]
    advantages = torch.tensor(
        [sequence.advantage for sequence in sequences], dtype=torch.float32, device=device
    )
    weights = torch.tensor(
        [sequence.weight for sequence in sequences], dtype=torch.float32, device=device
    )
    sequence_ids = torch.unique(
        torch.tensor(row.sequence_indices, device=device), return_inverse=True
    )[1]
    return advantages, weights, sequence_ids


def steps_over_groups(
    group_indices: Sequence[int], num_steps: int, *, seed: int
) -> list[list[int]]:
    """The groups shuffled (seeded) and split into ``num_steps`` near-equal parts (fewer when
    there are fewer groups: every step trains at least one whole group)."""
    order = list(group_indices)
    random.Random(seed).shuffle(order)
    parts = min(num_steps, len(order))
    return [order[i * len(order) // parts : (i + 1) * len(order) // parts] for i in range(parts)]


def art_row_length(sequences: Sequence[TokenizedSequence], *, max_seq_length: int) -> int:
    """ART's row length when ``packed_sequence_length`` is unset: the longest sequence rounded
    up to a multiple of 2048, at most the model's ``max_seq_length``
    (``LocalBackend._get_packed_tensors``)."""
    longest = max((len(sequence.token_ids) for sequence in sequences), default=1)
    return min(math.ceil(longest / ART_ROW_MULTIPLE) * ART_ROW_MULTIPLE, max_seq_length)


@dataclass
class ArtSteps:
    """ART's steps over a batch: the sequences of each row, each row's count for the
    learning-rate multiplier, and what was dropped for being longer than a row."""

    parts: list[list[TokenizedSequence]]
    trajectories: list[int]
    summary: Metrics
    # ART's warm-up cut of the first row: (index into the sequences, tokens kept), its count.
    warmup: tuple[list[tuple[int, int]], int]


def steps_per_row(sequences: Sequence[TokenizedSequence], row_length: int) -> ArtSteps:
    """ART's steps: one per row, the rows as ART fills and orders them (``art_layout``). The
    rows decide what each step trains on; how the trainer then lays a step out
    (``Trainer.packing``) does not change it. A sequence longer than a row is dropped whole,
    as ART drops it, and counted (``sequences/dropped``, ``tokens/dropped``)."""
    layout = art_layout(sequences, row_length=row_length)
    return ArtSteps(
        parts=[[sequences[index] for index in row] for row in layout.rows],
        trajectories=layout.trajectories,
        summary={
            "sequences/dropped": float(len(layout.dropped)),
            "tokens/dropped": float(sum(sequences[i].num_trained for i in layout.dropped)),
        },
        warmup=layout.warmup,
    )


def apply_art_weights(steps: Sequence[Packing], sequences: Sequence[TokenizedSequence]) -> None:
    """Set ART's token weights and rescaled advantages on the sequences the steps train
    (``advantages.art_weights``): token counts from every sequence of a trajectory as
    tokenized, sites from what the rows kept."""
    token_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    for sequence in sequences:
        token_counts[sequence.group_index, sequence.trajectory_index] += sequence.num_trained
    site_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    advantage: dict[tuple[int, int], float] = {}
    for packing in steps:
        for row in packing.rows:
            for index in row.sequence_indices:
                trained = packing.sequences[index]
                key = (trained.group_index, trained.trajectory_index)
                site_counts[key] += 1
                advantage[key] = trained.advantage
    keys = list(advantage)
    weights, advantages = art_weights(
        [token_counts[key] for key in keys],
        [advantage[key] for key in keys],
        [site_counts[key] for key in keys],
    )
    scaled = {key: (w, a) for key, w, a in zip(keys, weights, advantages, strict=True)}
    for packing in steps:
        for trained in packing.sequences:
            key = (trained.group_index, trained.trajectory_index)
            if key in scaled:
                trained.weight, trained.advantage = scaled[key]
