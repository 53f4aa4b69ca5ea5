"""The Tinker loop examples (``examples/tinker``), run against ``skytrain serve``: the supervised
loop lowers the loss; the RL loop runs its steps and raises the reward of SmolLM2 (one run on
SmolLM2 shows both: a run on the tiny model besides it would show nothing more)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tinker
from examples.tinker import rl_loop, sl_loop
from tests.fixtures.service import Service
from tests.tinker.conftest import tinker_key
from tests.tinker.test_sdk import TIMEOUT_S
from tinker import types

pytestmark = [pytest.mark.e2e]


def _named_checkpoints(service: Service, tenant: str) -> set[str]:
    rest = tinker.RestClient(base_url=service.url, api_key=tinker_key(service, tenant))
    listed = rest.list_user_checkpoints().result(timeout=60).checkpoints
    return {checkpoint.checkpoint_id for checkpoint in listed}


@pytest.mark.slow
def test_the_sl_loop_example_lowers_the_loss(
    tinker_service: Service, base_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", tinker_key(tinker_service, "erin"))
    config = sl_loop.Config(
        base_model=base_model,
        base_url=tinker_service.url,
        num_steps=6,
        batch_size=4,
        learning_rate=1e-2,
        lora_rank=8,
        save_every=3,
    )
    history = sl_loop.main(config)
    nll = [metrics["train_mean_nll"] for metrics in history]
    print(f"sl_loop train_mean_nll: {nll}")
    # The twelve conversations come round again every three steps: the same batches, a lower
    # loss over the three of them (one step of Adam at 1e-2 on the tiny model may overshoot).
    assert sum(nll[3:]) < sum(nll[:3])
    assert _named_checkpoints(tinker_service, "erin") == {"weights/000003", "sampler_weights/final"}


def _held_out_reward(
    sampler: tinker.SamplingClient, tokenizer: Any, problems: list[rl_loop.Problem]
) -> float:
    """The mean reward of 8 seeded samples per problem, scored as the loop scores them."""
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=777)
    futures = [
        sampler.sample(
            prompt=types.ModelInput.from_ints(rl_loop.prompt_tokens(tokenizer, problem)),
            num_samples=8,
            sampling_params=params,
        )
        for problem in problems
    ]
    rewards = [
        rl_loop.get_reward(str(tokenizer.decode(sequence.tokens, skip_special_tokens=True)), p)
        for future, p in zip(futures, problems, strict=True)
        for sequence in future.result(timeout=TIMEOUT_S).sequences
    ]
    return sum(rewards) / len(rewards)


@pytest.mark.slow
def test_the_rl_loop_example_raises_the_reward_of_smollm2(
    tinker_service: Service, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tinker_key(tinker_service, "grace")
    monkeypatch.setenv("TINKER_API_KEY", key)
    base_model = str(smollm2_path)
    config = rl_loop.Config(
        base_model=base_model,
        base_url=tinker_service.url,
        num_steps=6,
        batch_size=4,
        group_size=8,
        learning_rate=2e-3,
        lora_rank=8,
        max_tokens=3,
    )
    history = rl_loop.main(config)
    assert [metrics["step"] for metrics in history] == [
        float(step) for step in range(config.num_steps)
    ]
    assert all(0.0 <= metrics["reward/total"] <= 1.0 for metrics in history)
    assert _named_checkpoints(tinker_service, "grace") == {"weights/final"}
    rewards = [metrics["reward/total"] for metrics in history]
    print(f"rl_loop reward/total: {[round(reward, 3) for reward in rewards]}")
    # The loop's sampling is seeded, but single steps of 4 questions are still noisy: the best
    # of the last two steps beats the best of the first two.
    assert max(rewards[-2:]) > max(rewards[:2]) + 0.2

    client = tinker.ServiceClient(base_url=tinker_service.url, api_key=key)
    try:
        base = client.create_lora_training_client(base_model=base_model, rank=8).result(
            timeout=TIMEOUT_S
        )
        rest = tinker.RestClient(base_url=tinker_service.url, api_key=key)
        (final,) = [
            c
            for c in rest.list_user_checkpoints().result(timeout=60).checkpoints
            if c.checkpoint_id == "weights/final"
        ]
        trained = client.create_training_client_from_state(final.tinker_path).result(
            timeout=TIMEOUT_S
        )
        tokenizer = base.get_tokenizer()
        # Questions the loop never asked, sampled the same way from the base model and from
        # the trained one.
        asked = {
            problem
            for step in range(config.num_steps)
            for problem in rl_loop.problems(config.seed + step, config.batch_size)
        }
        unasked = dict.fromkeys(rl_loop.problems(seed=12345, count=100))
        held_out = [problem for problem in unasked if problem not in asked][:12]
        assert len(held_out) >= 8, held_out
        base_sampler = client.create_sampling_client(base_model=base_model).result(
            timeout=TIMEOUT_S
        )
        trained_sampler = trained.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
        before = _held_out_reward(base_sampler, tokenizer, held_out)
        after = _held_out_reward(trained_sampler, tokenizer, held_out)
        print(
            f"SmolLM2 held-out reward ({len(held_out)} questions x 8): {before:.3f} -> {after:.3f}"
        )
        assert after > before + 0.1

        # Sampling the base model agrees with a forward of the same tokens on SmolLM2 too.
        prompt = rl_loop.prompt_tokens(tokenizer, held_out[0])
        sampled = base_sampler.sample(
            prompt=types.ModelInput.from_ints(prompt),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=8, seed=3),
        ).result(timeout=TIMEOUT_S)
        differences = []
        for sequence in sampled.sequences:
            pad = len(prompt) - 1
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(prompt + sequence.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(
                        data=[0] * pad + sequence.tokens, dtype="int64"
                    ),
                },
            )
            (output,) = (
                base.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S).loss_fn_outputs
            )
            forward = output["logprobs"].tolist()[pad:]
            differences += [
                abs(a - b) for a, b in zip(forward, sequence.logprobs or [], strict=True)
            ]
        print(f"SmolLM2: max |forward - sampled| logprob = {max(differences):.2e}")
        assert max(differences) < 1e-3
    finally:
        client.close("success").result(timeout=60)
