"""Ask a model's endpoint to solve a Temporal Clue puzzle; the eval and the smoke run."""

from __future__ import annotations

import functools

import skytrain
from examples.common import training
from skytrain_backend.games.temporal_clue.play import (
    TemporalClueEpisode,
)
from skytrain_backend.games.temporal_clue.play import (
    TemporalClueScenario as Scenario,
)

PROJECT = "temporal-clue"
SEED_BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"


async def rollout(
    model: skytrain.Model,
    scenario: Scenario,
    *,
    max_tokens: int = 1024,
    temperature: float = 1.0,
) -> skytrain.Trajectory:
    """One puzzle, one answer of at most ``max_tokens`` tokens (reasoning included)."""
    episode = TemporalClueEpisode(scenario)
    return await training.run_episode(
        model, episode, max_tokens=max_tokens, temperature=temperature
    )


def task(
    *, suspects: int = 3, weapons: int = 3, rooms: int = 3, hours: int = 4, max_tokens: int = 1024
) -> training.Task[Scenario]:
    return training.Task(
        project=PROJECT,
        scenario=lambda seed: Scenario(
            seed=seed, suspects=suspects, weapons=weapons, rooms=rooms, hours=hours
        ),
        rollout=functools.partial(rollout, max_tokens=max_tokens),
    )


async def evaluate(model: skytrain.Model, n: int, *, max_tokens: int = 1024) -> dict[str, float]:
    """``val/reward`` (mean fraction of questions right) and ``val/solved`` over ``n`` puzzles."""
    return await training.evaluate(task(max_tokens=max_tokens), model, n)


async def smoke(backend: skytrain.Backend, base_model: str) -> training.SmokeRun:
    """The smallest puzzles (two suspects, weapons and hours; three rooms), short answers."""
    small = task(suspects=2, weapons=2, rooms=3, hours=2, max_tokens=24)
    return await training.smoke(small, backend, base_model)
