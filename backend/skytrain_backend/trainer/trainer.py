"""The training loop: a batch of scored groups (or SFT trajectories) to optimizer steps.

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

import functools
import itertools
from collections.abc import Callable, Iterator

import torch

from skytrain_backend.trainer.memory import (
    out_of_memory_as_error,
)
from skytrain_backend.trainer.plans import (
    OPTIMIZER_STATE,
    TRAINER_STATE,
    Metrics,
    RLPlan,
    SFTPlan,
    resolve_gradient_checkpointing,
    row_length_limit,
)
from skytrain_backend.trainer.rl import RLTraining
from skytrain_backend.trainer.sft import SFTTraining

__all__ = [
    "OPTIMIZER_STATE",
    "TRAINER_STATE",
    "RLPlan",
    "SFTPlan",
    "Trainer",
    "resolve_gradient_checkpointing",
    "row_length_limit",
]


class Trainer(RLTraining, SFTTraining):
    """A policy (base model + LoRA adapter), its optimizer, and the checkpoint step it is at."""

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
        position = plan.position
        if position.random_state is None:
            # torch's global generator, seeded per job and step (LoRA dropout draws from a
            # generator per row instead: ``_row_masks``).
            torch.manual_seed(plan.config.seed + self.step)
        else:
            # A resumed plan: the generators as its last step done left them.
            position.random_state.restore(self.policy.device)
        if isinstance(plan, RLPlan):
            with out_of_memory_as_error("ART's warm-up step", self.policy.device):
                self.art_warmup(plan)
        for number, step in enumerate(self._steps(plan), start=position.steps_done + 1):
            with out_of_memory_as_error(f"training step {number}", self.policy.device):
                metrics = step()
            position.advance(metrics, self.policy.device)
            self._record_step(metrics)
            yield metrics
        self.step += 1

    def _steps(self, plan: RLPlan | SFTPlan) -> Iterator[Callable[[], Metrics]]:
        """The plan's steps not done yet."""
        if isinstance(plan, RLPlan):
            for index in range(plan.steps_done, plan.num_gradient_steps):
                yield functools.partial(self._rl_step, plan, index)
        else:
            # The batches of the steps done are made again and dropped: each epoch's shuffle
            # draws from one seeded generator, so the later ones depend on the earlier ones.
            batches = itertools.islice(plan.batches(), plan.steps_done, None)
            for index, (sequences, learning_rate) in enumerate(batches, start=plan.steps_done):
                yield functools.partial(
                    self._sft_step, index, sequences, learning_rate, plan.config
                )
