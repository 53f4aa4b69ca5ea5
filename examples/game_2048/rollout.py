"""Play 2048 against a model's endpoint; the eval and the smoke run."""

from __future__ import annotations

import functools

import skytrain
from examples.common import training
from skytrain_backend.games.game_2048.play import Game2048Episode
from skytrain_backend.games.game_2048.play import Game2048Scenario as Scenario

PROJECT = "2048"
SEED_BASE_MODEL = "Qwen/Qwen2.5-3B-Instruct"


async def rollout(
    model: skytrain.Model,
    scenario: Scenario,
    *,
    max_tokens: int = 32,
    max_turns: int = 40,
    temperature: float = 1.0,
) -> skytrain.Trajectory:
    """One game, at most ``max_turns`` moves, each answer at most ``max_tokens`` tokens."""
    episode = Game2048Episode(scenario, max_turns=max_turns)
    return await training.run_episode(
        model, episode, max_tokens=max_tokens, temperature=temperature
    )


def task(
    *, target: int = 128, max_tokens: int = 32, max_turns: int = 40
) -> training.Task[Scenario]:
    return training.Task(
        project=PROJECT,
        scenario=lambda seed: Scenario(seed=seed, target=target),
        rollout=functools.partial(rollout, max_tokens=max_tokens, max_turns=max_turns),
    )


async def evaluate(model: skytrain.Model, n: int, *, target: int = 128) -> dict[str, float]:
    """``val/reward`` and the mean game metrics over ``n`` held-out games."""
    return await training.evaluate(task(target=target), model, n)


async def smoke(backend: skytrain.Backend, base_model: str) -> training.SmokeRun:
    """Short games (a 16 target, 3 moves) with short answers: one training step."""
    return await training.smoke(task(target=16, max_tokens=16, max_turns=3), backend, base_model)
