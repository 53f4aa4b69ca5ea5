"""What a job is before it runs: its optimizer steps, their rows and old logprobs
(``RLPlan``, ``SFTPlan``: ``kind`` says which), and the constants the RL and SFT steps share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from skytrain_backend.protocol import RLTrainConfig, SFTTrainConfig
from skytrain_backend.trainer.packing import Packing
from skytrain_backend.trainer.progress import Position
from skytrain_backend.trainer.tokenize import TokenizedSequence

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
class Agreement:
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


@dataclass(kw_only=True)
class _Plan:
    """Where a plan of either kind stands: the steps it has done and their metrics."""

    position: Position = field(default_factory=Position, repr=False)

    @property
    def steps_done(self) -> int:
        return self.position.steps_done

    @property
    def step_metrics(self) -> list[Metrics]:
        """The metrics of every step done, those done before a resume included."""
        return self.position.metrics


@dataclass
class RLPlan(_Plan):
    """An RL job ready to run: the rows of each optimizer step and what is known of them."""

    kind: ClassVar[Literal["rl"]] = "rl"
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
    agreement: Agreement | None = field(default=None, repr=False)
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
    def agreement_pending(self) -> bool:
        """True until the first step's forward pass has read the old logprobs of its rows:
        the ``logprob_agreement/*`` metrics and ``warning`` are known only then."""
        return self.agreement is not None


@dataclass
class SFTPlan(_Plan):
    """An SFT job ready to run: its optimizer steps' batches, made as the run reaches them
    (each epoch's shuffle when it starts), so a long run holds one step's data at a time."""

    kind: ClassVar[Literal["sft"]] = "sft"

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
