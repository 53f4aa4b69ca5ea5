"""Minimal RL through the Tinker API on skytrain: GRPO-style reward centering, one flat loop.

Written the way tinker-cookbook's ``recipes/rl_loop.py`` is: each step saves the weights for
the sampler, samples a group of answers per question, scores them, centers the rewards within
each group, and trains on the sampled tokens with the ``importance_sampling`` loss (the
sampler's logprobs in ``logprobs``, the advantage on every sampled token), skipping groups whose
answers all scored the same. The task: one-digit sums, rewarded when the answer starts with the
right digit. ``--seed`` picks the questions and seeds the sampling, so a run can be repeated.

    export TINKER_BASE_URL=http://127.0.0.1:8000             # your skytrain control plane
    export TINKER_API_KEY=$(skytrain keys create --tenant me --tinker)
    python -m examples.tinker.rl_loop --base-model HuggingFaceTB/SmolLM2-135M-Instruct

Variable names follow the cookbook's: ``_P`` problems, ``_G`` group members, ``_T`` tokens,
``_D`` datums.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import tinker
from tinker import types

logger = logging.getLogger(__name__)


@dataclass
class Config:
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    base_url: str | None = None  # default: $TINKER_BASE_URL
    batch_size: int = 4  # questions per step
    group_size: int = 8  # answers sampled per question
    learning_rate: float = 1e-4
    lora_rank: int = 16
    max_tokens: int = 4
    num_steps: int = 10
    loss_fn: types.LossFnType = "importance_sampling"
    seed: int = 0  # the questions and the sampling


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}? Reply with the number only."


def problems(seed: int, count: int) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a = rng.randint(0, 4)
        out.append(Problem(a, rng.randint(0, 9 - a)))
    return out


def prompt_tokens(tokenizer: Any, problem: Problem) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def get_reward(response: str, problem: Problem) -> float:
    return 1.0 if response.strip().startswith(problem.answer) else 0.0


def sampling_params(config: Config, step: int, index: int) -> types.SamplingParams:
    """Temperature 1, seeded: each question of each step has its own stream (the group's
    samples take seed, seed + 1, ...)."""
    seed = ((config.seed * config.num_steps + step) * config.batch_size + index) * config.group_size
    return types.SamplingParams(max_tokens=config.max_tokens, temperature=1.0, seed=seed)


def main(config: Config) -> list[dict[str, float]]:
    """Train; the metrics of every step (``reward/total`` among them)."""
    service_client = tinker.ServiceClient(base_url=config.base_url)
    try:
        training_client = service_client.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank
        ).result()
        tokenizer = training_client.get_tokenizer()
        adam_params = types.AdamParams(
            learning_rate=config.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8
        )
        history: list[dict[str, float]] = []
        for step in range(config.num_steps):
            start = time.time()
            sampling_client = training_client.save_weights_and_get_sampling_client().result()
            batch_P = problems(config.seed + step, config.batch_size)
            prompts_P = [types.ModelInput.from_ints(prompt_tokens(tokenizer, p)) for p in batch_P]
            futures_P = [
                sampling_client.sample(
                    prompt=prompt,
                    num_samples=config.group_size,
                    sampling_params=sampling_params(config, step, index),
                )
                for index, prompt in enumerate(prompts_P)
            ]

            datums_D: list[types.Datum] = []
            rewards_P: list[float] = []
            for future, prompt, problem in zip(futures_P, prompts_P, batch_P, strict=True):
                sequences_G = future.result().sequences
                rewards_G = [
                    get_reward(str(tokenizer.decode(seq.tokens, skip_special_tokens=True)), problem)
                    for seq in sequences_G
                ]
                mean_reward = sum(rewards_G) / len(rewards_G)
                rewards_P.append(mean_reward)
                advantages_G = [reward - mean_reward for reward in rewards_G]
                if all(advantage == 0.0 for advantage in advantages_G):
                    continue  # no signal in a group whose answers all scored the same
                for sequence, advantage in zip(sequences_G, advantages_G, strict=True):
                    sampled_tokens_T, logprobs_T = sequence.tokens, sequence.logprobs
                    assert logprobs_T is not None
                    ob_len = prompt.length - 1
                    model_input = prompt.append(
                        types.EncodedTextChunk(tokens=sampled_tokens_T[:-1])
                    )
                    datums_D.append(
                        types.Datum(
                            model_input=model_input,
                            loss_fn_inputs={
                                "target_tokens": types.TensorData(
                                    data=[0] * ob_len + sampled_tokens_T, dtype="int64"
                                ),
                                "logprobs": types.TensorData(
                                    data=[0.0] * ob_len + logprobs_T, dtype="float32"
                                ),
                                "advantages": types.TensorData(
                                    data=[0.0] * ob_len
                                    + [advantage] * (model_input.length - ob_len),
                                    dtype="float32",
                                ),
                            },
                        )
                    )

            metrics: dict[str, float] = {
                "step": float(step),
                "reward/total": sum(rewards_P) / len(rewards_P),
                "num_datums": float(len(datums_D)),
            }
            if datums_D:
                fwd_bwd_future = training_client.forward_backward(datums_D, loss_fn=config.loss_fn)
                optim_future = training_client.optim_step(adam_params)
                fwd_bwd_future.result()
                metrics.update(optim_future.result().metrics or {})
            else:
                logger.info("step %d: every group scored alike; no training step", step)
            metrics["time/total"] = time.time() - start
            logger.info("step %d: %s", step, metrics)
            history.append(metrics)
        training_client.save_state("final").result()
        return history
    finally:
        service_client.close("success").result()


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    parser.add_argument("--base-model", default=defaults.base_model)
    parser.add_argument("--base-url", default=None, help="default: $TINKER_BASE_URL")
    parser.add_argument("--steps", type=int, default=defaults.num_steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument(
        "--loss-fn", default=defaults.loss_fn, choices=["importance_sampling", "ppo", "cispo"]
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="questions and sampling")
    args = parser.parse_args(argv)
    return Config(
        base_model=args.base_model,
        base_url=args.base_url,
        num_steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        loss_fn=args.loss_fn,
        seed=args.seed,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    main(parse_args())
