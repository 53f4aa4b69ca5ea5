"""The demo's RL loop, written against the SDK alone, as a user would write it.

Each step samples ``rollouts_per_group`` rollouts of each of ``groups_per_step`` training
scenarios of the task (questions, games, puzzles: ``tasks``) through the model's OpenAI
endpoint, scores them, trains one GRPO step on them, and evaluates the new checkpoint on the
held-out scenarios (logged with ``split="val"``). Every completion is sampled with a seed
derived from the run's ``--seed``, so a run repeats itself on one machine (up to the
floating-point noise of batching), and every step is evaluated on the same seeds.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import skytrain
from skytrain_backend.demo.tasks import DemoTask, sampling_seed


@dataclass(frozen=True)
class LoopOptions:
    """What one demo run trains with (``skytrain demo --help`` documents each)."""

    steps: int
    groups_per_step: int
    rollouts_per_group: int
    learning_rate: float
    seed: int
    eval_questions: int
    temperature: float = 1.0
    # Tuned with the task (see README, "The demo"); not worth a command-line option.
    eval_samples: int = 2


@dataclass(frozen=True)
class StepRow:
    """One line of the demo's table. Step 0 is the base model: evaluated, not trained."""

    step: int
    train_reward: float | None
    eval_reward: float
    seconds: float
    # The mean of each of the task's columns (``DemoTask.columns``) over the held-out rollouts.
    eval_metrics: dict[str, float] = field(default_factory=dict)


def _mean(groups: Sequence[skytrain.TrajectoryGroup], metric: str | None = None) -> float:
    trajectories = [t for group in groups for t in group.trajectories]
    if metric is None:
        return statistics.fmean(t.reward for t in trajectories)
    return statistics.fmean(float(t.metrics[metric]) for t in trajectories)


async def _gather(
    task: DemoTask[Any],
    model: skytrain.Model,
    scenarios: Sequence[Any],
    *,
    per_scenario: int,
    options: LoopOptions,
    seeds: str,
    desc: str,
) -> list[skytrain.TrajectoryGroup]:
    """``per_scenario`` rollouts of each scenario, the j-th one sampled with the seed of (the
    run's seed, ``seeds``, the scenario, j)."""
    return await skytrain.gather_trajectory_groups(
        (
            skytrain.TrajectoryGroup(
                task.rollout(
                    model,
                    scenario,
                    temperature=options.temperature,
                    seed=sampling_seed(options.seed, seeds, task.label(scenario), j),
                )
                for j in range(per_scenario)
            )
            for scenario in scenarios
        ),
        pbar_desc=desc,
    )


def training_batches(
    scenarios: Sequence[Any], *, steps: int, per_step: int, seed: int
) -> list[list[Any]]:
    """The scenarios of each step: the training set shuffled by ``seed``, taken in turn."""
    order = list(scenarios)
    random.Random(seed).shuffle(order)
    return [
        [order[(step * per_step + i) % len(order)] for i in range(per_step)]
        for step in range(steps)
    ]


async def train(
    task: DemoTask[Any],
    model: skytrain.TrainableModel,
    options: LoopOptions,
    *,
    on_row: Callable[[StepRow], None],
) -> list[StepRow]:
    """Evaluate the base model, then train and evaluate ``options.steps`` times."""
    train_scenarios, held_out = task.split()
    held_out = held_out[: options.eval_questions]
    config = skytrain.TrainConfig(learning_rate=options.learning_rate, seed=options.seed)
    rows: list[StepRow] = []

    async def evaluate(step: int, started: float, train_reward: float | None) -> None:
        # Every step is evaluated with the same seeds, so two steps' rewards differ by what the
        # model learned, not by the luck of their samples.
        groups = await _gather(
            task,
            model,
            held_out,
            per_scenario=options.eval_samples,
            options=options,
            seeds="eval",
            desc=f"step {step} eval",
        )
        await model.log(groups, split="val")
        rows.append(
            StepRow(
                step=step,
                train_reward=train_reward,
                eval_reward=_mean(groups),
                seconds=time.monotonic() - started,
                eval_metrics={column.key: _mean(groups, column.key) for column in task.columns},
            )
        )
        on_row(rows[-1])

    first_step = await model.get_step()
    await evaluate(first_step, time.monotonic(), None)
    batches = training_batches(
        train_scenarios, steps=options.steps, per_step=options.groups_per_step, seed=options.seed
    )
    for scenarios in batches:
        started = time.monotonic()
        step = rows[-1].step + 1
        groups = await _gather(
            task,
            model,
            scenarios,
            per_scenario=options.rollouts_per_group,
            options=options,
            seeds=f"step {step}",
            desc=f"step {step} rollouts",
        )
        result = await model.train(groups, config=config)
        await evaluate(result.step, started, _mean(groups))
    return rows
