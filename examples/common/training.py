"""The rollout loop, training loop, eval and smoke run that every example shares.

Everything here goes through the SDK: the model is reached only through
``model.openai_client()``, so a rollout runs against any base model a skytrain backend serves,
or against any OpenAI-compatible endpoint through a prompted ``skytrain.Model``.

Scenario seeds: training step ``s`` plays seeds ``seed + s * groups + g``, so a resumed run
meets new scenarios; the eval always plays seeds from ``EVAL_SEED_OFFSET`` on, which training
(with seeds below it) never sees.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import skytrain
from skytrain_backend.games.episode import Episode

ScenarioT = TypeVar("ScenarioT")
EVAL_SEED_OFFSET = 1_000_000


async def run_episode(
    model: skytrain.Model, episode: Episode, *, max_tokens: int, temperature: float = 1.0
) -> skytrain.Trajectory:
    """Play an episode to its end, one chat completion per turn, and score it."""
    client = model.openai_client()
    # Tools are sent only when the task has some: an empty list is not a valid request.
    tools: dict[str, Any] = {"tools": episode.tools} if episode.tools else {}
    while not episode.done:
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=episode.messages(),
            max_tokens=max_tokens,
            temperature=temperature,
            **tools,
        )
        episode.step(completion.choices[0])
    return episode_trajectory(episode)


def episode_trajectory(episode: Episode) -> skytrain.Trajectory:
    """The scored trajectory of an episode, its sampled choices kept as they came back."""
    return skytrain.Trajectory(
        messages_and_choices=episode.messages_and_choices,
        reward=episode.reward(),
        metrics=episode.metrics(),
        metadata=episode.metadata(),
        tools=episode.tools,
    )


@dataclass(frozen=True)
class Task(Generic[ScenarioT]):
    """An example as the training loop sees it: scenarios by seed, and a rollout of one."""

    project: str
    scenario: Callable[[int], ScenarioT]
    rollout: Callable[[skytrain.Model, ScenarioT], Awaitable[skytrain.Trajectory]]


async def gather(
    task: Task[Any],
    model: skytrain.Model,
    seeds: Iterable[int],
    *,
    rollouts_per_group: int,
    desc: str,
    max_exceptions: int = 0,
) -> list[skytrain.TrajectoryGroup]:
    """One group per seed, ``rollouts_per_group`` rollouts of that scenario in each."""
    return await skytrain.gather_trajectory_groups(
        (
            skytrain.TrajectoryGroup(
                task.rollout(model, task.scenario(seed)) for _ in range(rollouts_per_group)
            )
            for seed in seeds
        ),
        pbar_desc=desc,
        max_exceptions=max_exceptions,
    )


def summarize(groups: Sequence[skytrain.TrajectoryGroup], split: str) -> dict[str, float]:
    """Mean reward and mean of every trajectory metric, keyed ``<split>/<name>``."""
    trajectories = [t for group in groups for t in group.trajectories]
    if not trajectories:
        return {}
    summary = {f"{split}/reward": statistics.fmean(t.reward for t in trajectories)}
    for key in sorted({key for t in trajectories for key in t.metrics}):
        values = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        summary[f"{split}/{key}"] = statistics.fmean(values)
    return summary


def eval_seeds(n: int) -> range:
    return range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + n)


async def evaluate_groups(
    task: Task[Any], model: skytrain.Model, n: int
) -> list[skytrain.TrajectoryGroup]:
    """One rollout on each of the ``n`` held-out scenarios."""
    return await gather(task, model, eval_seeds(n), rollouts_per_group=1, desc="eval")


async def evaluate(task: Task[Any], model: skytrain.Model, n: int) -> dict[str, float]:
    """Metrics of the model on ``n`` held-out scenarios (``val/reward``, ``val/<metric>``)."""
    return summarize(await evaluate_groups(task, model, n), "val")


@dataclass(frozen=True)
class TrainOptions:
    base_model: str
    name: str
    steps: int
    groups: int
    rollouts_per_group: int
    learning_rate: float
    eval_n: int
    eval_every: int
    seed: int
    max_exceptions: int
    base_url: str | None
    api_key: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {number}")
    return number


def training_parser(
    module: str, description: str | None, *, project: str, base_model: str
) -> argparse.ArgumentParser:
    """The options every training script shares; scripts add their task's own."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument(
        "--base-model",
        default=base_model,
        help="Hugging Face id or local directory (default: %(default)s)",
    )
    parser.add_argument(
        "--name", default=f"{project}-001", help="model name in the project (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=20, help="training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--groups", type=positive_int, default=8, help="scenarios per step (default: %(default)s)"
    )
    parser.add_argument(
        "--rollouts-per-group",
        type=positive_int,
        default=8,
        help="rollouts of each scenario (default: %(default)s)",
    )
    parser.add_argument(
        "--learning-rate",
        type=positive_float,
        default=1e-5,
        help="learning rate of the LoRA update (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-n",
        type=non_negative_int,
        default=16,
        help="held-out scenarios per eval, 0 for none (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        default=5,
        help="steps between evals (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the first training scenario (default: %(default)s)",
    )
    parser.add_argument(
        "--max-exceptions",
        type=non_negative_int,
        default=0,
        help="failed rollouts tolerated per step (default: %(default)s)",
    )
    parser.add_argument(
        "--base-url", help="control plane URL (default: $SKYTRAIN_BASE_URL or 127.0.0.1:8000)"
    )
    parser.add_argument("--api-key", help="API key (default: $SKYTRAIN_API_KEY)")
    return parser


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, task: Task[Any]) -> None:
    """Check the task's options on one scenario (a usage error if wrong), then train."""
    try:
        task.scenario(args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(train(task, TrainOptions.from_args(args)))


async def _evaluate_and_log(
    task: Task[Any], model: skytrain.TrainableModel, n: int
) -> dict[str, float]:
    groups = await evaluate_groups(task, model, n)
    if groups:
        await model.log(groups, split="val")
    return summarize(groups, "val")


def _print_row(row: dict[str, float]) -> None:
    cells = [f"step {int(row['step']):>4}"]
    cells += [f"{key} {value:8.4f}" for key, value in row.items() if key.endswith("/reward")]
    print("  ".join(cells), flush=True)


async def train(
    task: Task[Any], options: TrainOptions, *, backend: skytrain.Backend | None = None
) -> list[dict[str, float]]:
    """Register the model and run ``options.steps`` GRPO steps; one row of metrics per step.

    The held-out eval runs before the first step and every ``eval_every`` steps (and after
    the last); when it ran, checkpoints other than the latest and the best by ``val/reward``
    are deleted at the end.
    """
    own_backend = backend is None
    backend = backend or skytrain.Backend(base_url=options.base_url, api_key=options.api_key)
    try:
        model = skytrain.TrainableModel(
            name=options.name, project=task.project, base_model=options.base_model
        )
        await model.register(backend)
        step = await model.get_step()
        rows: list[dict[str, float]] = []
        if options.eval_n:
            rows.append({"step": step, **await _evaluate_and_log(task, model, options.eval_n)})
            _print_row(rows[-1])
        for index in range(options.steps):
            seeds = range(
                options.seed + step * options.groups, options.seed + (step + 1) * options.groups
            )
            groups = await gather(
                task,
                model,
                seeds,
                rollouts_per_group=options.rollouts_per_group,
                desc=f"step {step + 1} rollouts",
                max_exceptions=options.max_exceptions,
            )
            result = await model.train(
                groups, config=skytrain.TrainConfig(learning_rate=options.learning_rate)
            )
            step = result.step
            row = {"step": step, **summarize(groups, "train")}
            last = index == options.steps - 1
            if options.eval_n and (last or (index + 1) % options.eval_every == 0):
                row.update(await _evaluate_and_log(task, model, options.eval_n))
            rows.append(row)
            _print_row(row)
        if options.eval_n:
            await model.delete_checkpoints(best_checkpoint_metric="val/reward")
        return rows
    finally:
        if own_backend:
            await backend.close()


@dataclass(frozen=True)
class SmokeRun:
    """What one smoke training step did."""

    model: skytrain.TrainableModel
    step_before: int
    step_after: int
    result: skytrain.TrainResult
    groups: list[skytrain.TrajectoryGroup]


async def smoke(
    task: Task[Any],
    backend: skytrain.Backend,
    base_model: str,
    *,
    groups: int = 2,
    rollouts_per_group: int = 2,
) -> SmokeRun:
    """Register a fresh model, gather a few rollouts through its endpoint, train one step."""
    model = skytrain.TrainableModel(
        name=f"smoke-{uuid.uuid4().hex[:8]}", project=task.project, base_model=base_model
    )
    await model.register(backend)
    step_before = await model.get_step()
    gathered = await gather(
        task, model, range(groups), rollouts_per_group=rollouts_per_group, desc="smoke rollouts"
    )
    result = await model.train(gathered, config=skytrain.TrainConfig(learning_rate=1e-5))
    return SmokeRun(
        model=model,
        step_before=step_before,
        step_after=await model.get_step(),
        result=result,
        groups=gathered,
    )
