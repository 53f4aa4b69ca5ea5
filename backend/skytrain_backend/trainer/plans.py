"""What a job is before it runs: its optimizer steps, their rows and old logprobs, and the
rules that split a batch into steps (``RLPlan``, ``SFTPlan``), shared by the RL and SFT loops."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from skytrain_backend.protocol import (
    ART_ROW_MULTIPLE,
    RLTrainConfig,
    SFTTrainConfig,
)
from skytrain_backend.trainer.advantages import art_weights
from skytrain_backend.trainer.art_layout import art_layout
from skytrain_backend.trainer.packing import PackedRow, Packing
from skytrain_backend.trainer.progress import Position
from skytrain_backend.trainer.tokenize import (
    TokenizedSequence,
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


# ART's warm-up step's learning rate (``art/preprocessing/inputs.py``).
ART_WARMUP_LEARNING_RATE = 1e-9


@dataclass
class WarmupRow:
    """ART's warm-up step (``art_layout``): its rows, and its count for the rate multiplier."""

    packing: Packing
    rate_count: int


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
    position: Position = field(default_factory=Position, repr=False)
    # ART's steps: per step, ART's count for the learning-rate multiplier (``art_layout``);
    # None: each step's number of trajectories.
    rate_counts: list[int] | None = None
    # ``warmup_step``: what a trainer with a fresh optimizer steps on first.
    warmup: WarmupRow | None = None

    @property
    def num_gradient_steps(self) -> int:
        return len(self.steps)

    def learning_rate_multiplier(self, index: int) -> float:
        """Step ``index``'s learning rate over the job's: its count (trajectories, or ART's
        count) to the power ``num_trajectories_learning_rate_multiplier_power``. A count of 0
        (an ART row that shares no prefix) gives 0 for a positive power, as ART's does, and 1
        for a negative one, where ART's would fail dividing by zero."""
        power = self.config.num_trajectories_learning_rate_multiplier_power
        if power == 0:
            return 1.0
        if self.rate_counts is not None:
            count = self.rate_counts[index]
        else:
            sequences = self.steps[index].sequences
            count = len({(s.group_index, s.trajectory_index) for s in sequences})
        if count == 0:
            return 0.0 if power > 0 else 1.0
        return float(count) ** power

    @property
    def steps_done(self) -> int:
        return self.position.steps_done

    @property
    def step_metrics(self) -> list[Metrics]:
        """The metrics of every step done, those done before a resume included."""
        return self.position.metrics

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
    position: Position = field(default_factory=Position, repr=False)

    @property
    def num_gradient_steps(self) -> int:
        return self.num_steps

    @property
    def steps_done(self) -> int:
        return self.position.steps_done

    @property
    def step_metrics(self) -> list[Metrics]:
        """The metrics of every step done, those done before a resume included."""
        return self.position.metrics

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


def _steps_over_groups(
    group_indices: Sequence[int], num_steps: int, *, seed: int
) -> list[list[int]]:
    """The groups shuffled (seeded) and split into ``num_steps`` near-equal parts (fewer when
    there are fewer groups: every step trains at least one whole group)."""
    order = list(group_indices)
    random.Random(seed).shuffle(order)
    parts = min(num_steps, len(order))
    return [order[i * len(order) // parts : (i + 1) * len(order) // parts] for i in range(parts)]


def resolve_gradient_checkpointing(
    requested: bool | None, *, default: bool | None, device: torch.device
) -> bool:
    """The model config's choice, else the worker's (its memory plan), else on with CUDA:
    a GPU shared with an engine has little room for activations, and checkpointing trades a
    second forward pass for most of them."""
    if requested is not None:
        return requested
    if default is not None:
        return default
    return device.type == "cuda"


def row_length_limit(requested: int, *limits: int | None) -> int:
    """``requested`` cut to every limit that is set."""
    return min([requested, *(limit for limit in limits if limit is not None)])


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


def _steps_per_row(sequences: Sequence[TokenizedSequence], row_length: int) -> ArtSteps:
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


def _apply_art_weights(steps: Sequence[Packing], sequences: Sequence[TokenizedSequence]) -> None:
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
