"""Play tic-tac-toe against a model's endpoint; the eval and the smoke run."""

from __future__ import annotations

import functools

import skytrain
from examples.common import training
from skytrain_backend.games.tic_tac_toe.play import TicTacToeEpisode
from skytrain_backend.games.tic_tac_toe.play import TicTacToeScenario as Scenario

PROJECT = "tic-tac-toe"
SEED_BASE_MODEL = "Qwen/Qwen2.5-3B-Instruct"


async def rollout(
    model: skytrain.Model,
    scenario: Scenario,
    *,
    max_tokens: int = 32,
    max_turns: int = 5,
    temperature: float = 1.0,
) -> skytrain.Trajectory:
    """One game (the agent moves at most five times), each answer at most ``max_tokens``."""
    episode = TicTacToeEpisode(scenario, max_turns=max_turns)
    return await training.run_episode(
        model, episode, max_tokens=max_tokens, temperature=temperature
    )


def task(*, opponent: str = "random", max_tokens: int = 32) -> training.Task[Scenario]:
    """Even seeds: the agent moves first; odd seeds: the opponent does."""
    return training.Task(
        project=PROJECT,
        scenario=lambda seed: Scenario(seed=seed, agent_first=seed % 2 == 0, opponent=opponent),
        rollout=functools.partial(rollout, max_tokens=max_tokens),
    )


async def evaluate(model: skytrain.Model, n: int, *, opponent: str = "random") -> dict[str, float]:
    """``val/reward`` and the win/draw/loss/invalid rates over ``n`` held-out games."""
    return await training.evaluate(task(opponent=opponent), model, n)


async def smoke(backend: skytrain.Backend, base_model: str) -> training.SmokeRun:
    return await training.smoke(task(max_tokens=16), backend, base_model)
