"""Repeated sample -> score -> prepare_rl + run steps raise the reward.

The tiny model is random: its next-token distribution is nearly uniform over 49k tokens, and a
LoRA update only lifts the tokens it was trained on, so no reward on token identity can move it
directly. It first learns, by SFT, to answer with words from a 16-colour alphabet (uniformly);
GRPO then has to shift it towards the 4 colours the reward likes, which it can only learn from
its own samples and their rewards.

The SmolLM2 variant (``slow``) needs no warm-up: a real instruct model learns to open its
answers with the word the reward likes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.protocol import (
    DEFAULT_LORA_TARGET_MODULES,
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.tokenize import end_of_turn_token_id
from tests.fixtures.sampling import sample_choices

COLORS = (
    "red blue green black white brown pink gray gold silver orange purple yellow cyan navy olive"
)
Reward = Callable[[dict[str, Any]], float]


def _token_ids(choice: dict[str, Any]) -> list[int]:
    return [
        int(entry["token"].removeprefix("token_id:")) for entry in choice["logprobs"]["content"]
    ]


def _mean_reward(
    trainer: Trainer,
    prompts: list[list[dict[str, Any]]],
    reward: Reward,
    *,
    n: int,
    max_new_tokens: int,
) -> float:
    rewards = [
        reward(choice)
        for k, prompt in enumerate(prompts)
        for choice in sample_choices(
            trainer.policy.model,
            trainer.policy.tokenizer,
            prompt,
            n=n,
            max_new_tokens=max_new_tokens,
            seed=10_000 + k,  # the same evaluation samples' randomness before and after
        )
    ]
    return sum(rewards) / len(rewards)


def _grpo(
    trainer: Trainer,
    prompts: list[list[dict[str, Any]]],
    reward: Reward,
    config: RLTrainConfig,
    *,
    iterations: int,
    group_size: int,
    max_new_tokens: int,
) -> list[float]:
    """Sample a group per prompt, score, train; returns each iteration's mean batch reward."""
    batch_rewards = []
    for iteration in range(iterations):
        groups = []
        for k, prompt in enumerate(prompts):
            choices = sample_choices(
                trainer.policy.model,
                trainer.policy.tokenizer,
                prompt,
                n=group_size,
                max_new_tokens=max_new_tokens,
                seed=100 * iteration + k,
            )
            groups.append(
                TrajectoryGroup.model_validate(
                    {
                        "trajectories": [
                            {"messages_and_choices": [*prompt, c], "reward": reward(c)}
                            for c in choices
                        ]
                    }
                )
            )
        plan = trainer.prepare_rl(groups, config)
        batch_rewards.append(plan.summary["train/reward"])
        list(trainer.run(plan))
    return batch_rewards


@pytest.mark.slow
def test_grpo_raises_the_reward_of_the_tiny_model(tiny_model_path: Path) -> None:
    # lm_head is adapted too: a random model's output layer is where a vocabulary is learned.
    model_config = ModelConfig(lora_target_modules=[*DEFAULT_LORA_TARGET_MODULES, "lm_head"])
    trainer = Trainer.load(str(tiny_model_path), model_config=model_config, device="cpu")
    tokenizer = trainer.policy.tokenizer
    end = end_of_turn_token_id(tokenizer)
    alphabet = [
        tokenizer(" " + color, add_special_tokens=False)["input_ids"][0] for color in COLORS.split()
    ]
    assert len(set(alphabet)) == 16
    liked = set(alphabet[:4])
    prompts = [[{"role": "user", "content": f"Name some colors ({k})."}] for k in range(4)]

    rng = random.Random(0)
    warm_up = [
        Trajectory.model_validate(
            {
                "messages_and_choices": [
                    *prompts[k % 4],
                    {
                        "message": {"role": "assistant", "content": "colors"},
                        "logprobs": {
                            "content": [
                                {"token": f"token_id:{token}", "logprob": 0.0}
                                for token in [*rng.choices(alphabet, k=6), end]
                            ]
                        },
                    },
                ],
                "reward": 0.0,
            }
        )
        for k in range(64)
    ]
    list(
        trainer.run(
            trainer.prepare_sft(
                warm_up, SFTTrainConfig(learning_rate=1e-2, batch_size=16, num_epochs=6)
            )
        )
    )

    def in_alphabet(choice: dict[str, Any]) -> float:
        tokens = _token_ids(choice)
        return sum(t in alphabet or t == end for t in tokens) / len(tokens)

    def liked_fraction(choice: dict[str, Any]) -> float:
        tokens = [t for t in _token_ids(choice) if t != end]
        return sum(t in liked for t in tokens) / max(len(tokens), 1)

    assert _mean_reward(trainer, prompts, in_alphabet, n=16, max_new_tokens=8) > 0.9
    before = _mean_reward(trainer, prompts, liked_fraction, n=32, max_new_tokens=8)
    batch_rewards = _grpo(
        trainer,
        prompts,
        liked_fraction,
        RLTrainConfig(learning_rate=1e-2),
        iterations=6,
        group_size=8,
        max_new_tokens=8,
    )
    after = _mean_reward(trainer, prompts, liked_fraction, n=32, max_new_tokens=8)
    print(
        f"tiny model, liked-colour fraction: {before:.3f} -> {after:.3f}; batches {batch_rewards}"
    )
    assert before < 0.4  # 4 of 16 colours: about a quarter before RL
    assert after > before + 0.25


@pytest.mark.slow
def test_grpo_teaches_smollm2_the_rewarded_opening_word(smollm2_path: Path) -> None:
    trainer = Trainer.load(str(smollm2_path), model_config=ModelConfig(), device="cpu")
    tokenizer = trainer.policy.tokenizer
    prompts = [
        [{"role": "user", "content": q}] for q in ("Name a fruit.", "What color is the sky?")
    ]

    def opens_with_the(choice: dict[str, Any]) -> float:
        return float(tokenizer.decode(_token_ids(choice)[:1]).strip() == "The")

    # Three tokens per answer keep sampling cheap; the reward is decided by the first.
    before = _mean_reward(trainer, prompts, opens_with_the, n=24, max_new_tokens=3)
    batch_rewards = _grpo(
        trainer,
        prompts,
        opens_with_the,
        # Two optimizer steps per batch, one group each.
        RLTrainConfig(learning_rate=1e-3, num_gradient_steps=2),
        iterations=3,
        group_size=8,
        max_new_tokens=3,
    )
    after = _mean_reward(trainer, prompts, opens_with_the, n=24, max_new_tokens=3)
    print(
        f"SmolLM2, answers opening with 'The': {before:.3f} -> {after:.3f}; batches {batch_rewards}"
    )
    assert after > before + 0.25
