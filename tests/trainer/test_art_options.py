"""ART's training options, as ART's ServerlessBackend sends them, each change what a step does.

The loss functions are checked against reference implementations of ART's definitions in
``test_loss.py``; here each option travels the way a job does (ART's request body, then
``RLTrainConfig.from_experimental``, then the trainer), one at a time from ART's defaults, on
the same batch of off-policy tokens (the sampler's logprobs moved away from the trainer's, so
ratios are not 1 and every option has something to act on).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.fixtures.art import ART_EVERY_OPTION, art_train_request
from tests.fixtures.sampling import sample_choices

QUESTIONS = ["Name a color.", "Count to three."]
# Spreads that differ between groups: scaling by each group's standard deviation then changes
# the update even after ART's renormalization of the advantages.
REWARDS = [(0.0, 1.0, 0.2, 3.0), (0.0, 0.5, 0.1, 0.3)]


def _off_policy_groups(trainer: Trainer) -> list[TrajectoryGroup]:
    rng = random.Random(0)
    groups = []
    for g, question in enumerate(QUESTIONS):
        prompt = [{"role": "user", "content": question}]
        choices = sample_choices(
            trainer.policy.model, trainer.policy.tokenizer, prompt, n=4, max_new_tokens=8, seed=g
        )
        for choice in choices:
            for entry in choice["logprobs"]["content"]:
                entry["logprob"] += rng.uniform(-1.0, 1.0)  # ratios from about 0.4 to 2.7
        groups.append(
            TrajectoryGroup.model_validate(
                {
                    "trajectories": [
                        {"messages_and_choices": [*prompt, choice], "reward": reward}
                        for reward, choice in zip(REWARDS[g], choices, strict=True)
                    ]
                }
            )
        )
    return groups


def _update(path: Path, groups: list[TrajectoryGroup], **options: Any) -> dict[str, torch.Tensor]:
    body = art_train_request("model", [], **options)
    config = RLTrainConfig.from_experimental(body["experimental_config"])
    trainer = Trainer.load(str(path), model_config=ModelConfig(), device="cpu")
    list(trainer.run(trainer.prepare_rl(groups, config)))
    return {
        name: parameter.detach().clone()
        for name, parameter in trainer.policy.model.named_parameters()
        if parameter.requires_grad
    }


@pytest.fixture(scope="module")
def groups(tiny_model_path: Path) -> list[TrajectoryGroup]:
    trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    return _off_policy_groups(trainer)


# What an option needs alongside it to have something to act on: ART's CISPO default clips to
# (0, 5), so its mask drops nothing where PPO's does; the KL's source matters once it is on.
CONTEXT: dict[str, dict[str, Any]] = {
    "mask_prob_ratio": {"loss_fn": "ppo"},
    "kl_penalty_source": {"kl_penalty_coef": 0.5, "kl_penalty_source": "sample"},
}


@pytest.mark.slow
def test_each_option_of_arts_train_call_changes_the_update(
    tiny_model_path: Path, groups: list[TrajectoryGroup]
) -> None:
    references: dict[str, dict[str, torch.Tensor]] = {}
    for option, value in ART_EVERY_OPTION.items():
        context = {"learning_rate": 1e-2} | CONTEXT.get(option, {})
        key = repr(sorted(context.items()))
        if key not in references:
            references[key] = _update(tiny_model_path, groups, **context)
        reference = references[key]
        updated = _update(tiny_model_path, groups, **(context | {option: value}))
        assert any(not torch.equal(updated[k], reference[k]) for k in reference), option
