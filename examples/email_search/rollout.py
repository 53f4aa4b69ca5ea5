"""Run the email agent against a model's endpoint; the eval and the smoke run."""

from __future__ import annotations

import functools

import skytrain
from examples.common import training
from examples.email_search.agent import EmailSearchEpisode, Scenario

PROJECT = "email-search"
DEFAULT_BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"


async def rollout(
    model: skytrain.Model,
    scenario: Scenario,
    *,
    max_tokens: int = 256,
    max_turns: int = 6,
    temperature: float = 1.0,
) -> skytrain.Trajectory:
    """At most ``max_turns`` tool-calling turns of at most ``max_tokens`` tokens each."""
    episode = EmailSearchEpisode(scenario, max_turns=max_turns)
    return await training.run_episode(
        model, episode, max_tokens=max_tokens, temperature=temperature
    )


def task(
    *, inbox_size: int = 20, max_tokens: int = 256, max_turns: int = 6
) -> training.Task[Scenario]:
    return training.Task(
        project=PROJECT,
        scenario=lambda seed: Scenario(seed=seed, inbox_size=inbox_size),
        rollout=functools.partial(rollout, max_tokens=max_tokens, max_turns=max_turns),
    )


async def evaluate(model: skytrain.Model, n: int, *, inbox_size: int = 20) -> dict[str, float]:
    """``val/reward`` and the answered/correct/cited rates over ``n`` held-out questions."""
    return await training.evaluate(task(inbox_size=inbox_size), model, n)


async def smoke(backend: skytrain.Backend, base_model: str) -> training.SmokeRun:
    """Small inboxes, two turns of short answers."""
    return await training.smoke(task(inbox_size=6, max_tokens=24, max_turns=2), backend, base_model)
