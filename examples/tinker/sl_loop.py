"""Minimal supervised fine-tuning through the Tinker API on skytrain: one flat loop.

Written the way tinker-cookbook's ``recipes/sl_loop.py`` is (render each conversation, train
on the assistant's tokens with ``cross_entropy``, one ``optim_step`` per batch with a linearly
decaying learning rate, save the state now and then, save sampler weights at the end), but with
only the official ``tinker`` SDK and a small built-in dataset, so it runs anywhere.

    export TINKER_BASE_URL=http://127.0.0.1:8000             # your skytrain control plane
    export TINKER_API_KEY=$(skytrain keys create --tenant me --tinker)
    python -m examples.tinker.sl_loop --base-model HuggingFaceTB/SmolLM2-135M-Instruct

The tokenizer is the base model's, loaded by the SDK (``get_tokenizer``): the base model must
be a Hugging Face id this machine can load, or a local model directory.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import tinker
from tinker import types

logger = logging.getLogger(__name__)

# Short factual exchanges: enough to watch the loss fall within a few steps.
CONVERSATIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", "Paris."),
    ("What colour is the sky on a clear day?", "Blue."),
    ("How many legs does a spider have?", "Eight."),
    ("What do bees make?", "Honey."),
    ("What is 2 + 2?", "4."),
    ("Which planet is known as the red planet?", "Mars."),
    ("What is frozen water called?", "Ice."),
    ("How many days are in a week?", "Seven."),
    ("What is the opposite of hot?", "Cold."),
    ("What animal says moo?", "A cow."),
    ("What is the largest ocean?", "The Pacific."),
    ("How many hours are in a day?", "Twenty-four."),
]


@dataclass
class Config:
    base_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    base_url: str | None = None  # default: $TINKER_BASE_URL
    batch_size: int = 4
    learning_rate: float = 1e-4
    lora_rank: int = 16
    num_steps: int = 12
    save_every: int = 6  # 0 = never
    max_length: int = 512
    conversations: list[tuple[str, str]] = field(default_factory=lambda: list(CONVERSATIONS))


def conversation_to_datum(
    tokenizer: Any, question: str, answer: str, max_length: int
) -> types.Datum:
    """The chat-rendered conversation, shifted by one token: weight 1 on the answer's tokens."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=False,
    )
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False)
    tokens = tokenizer.encode(full, add_special_tokens=False)[:max_length]
    weights = [0.0] * len(prompt_tokens) + [1.0] * (len(tokens) - len(prompt_tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=weights[1:], dtype="float32"),
        },
    )


def mean_nll(result: types.ForwardBackwardOutput, batch: list[types.Datum]) -> float:
    """The weighted mean negative log-likelihood of the targets, from the returned logprobs."""
    total = weight_sum = 0.0
    for output, datum in zip(result.loss_fn_outputs, batch, strict=True):
        logprobs = output["logprobs"].tolist()
        weights = datum.loss_fn_inputs["weights"].tolist()
        total += -sum(lp * w for lp, w in zip(logprobs, weights, strict=True))
        weight_sum += sum(weights)
    return total / max(weight_sum, 1.0)


def main(config: Config) -> list[dict[str, float]]:
    """Train; the metrics of every step."""
    service_client = tinker.ServiceClient(base_url=config.base_url)
    try:
        training_client = service_client.create_lora_training_client(
            base_model=config.base_model, rank=config.lora_rank
        ).result()
        tokenizer = training_client.get_tokenizer()
        data = [
            conversation_to_datum(tokenizer, question, answer, config.max_length)
            for question, answer in config.conversations
        ]
        history: list[dict[str, float]] = []
        for step in range(config.num_steps):
            start = time.time()
            if config.save_every and step % config.save_every == 0 and step > 0:
                training_client.save_state(f"{step:06d}").result()

            # Linear learning-rate decay, as the cookbook's loop does.
            learning_rate = config.learning_rate * (1.0 - step / config.num_steps)
            first = (step * config.batch_size) % len(data)
            batch = [data[(first + i) % len(data)] for i in range(config.batch_size)]

            # Submit both before waiting: the server runs them back to back.
            fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
            optim_future = training_client.optim_step(
                types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
            )
            fwd_bwd_result = fwd_bwd_future.result()
            optim_result = optim_future.result()

            metrics = {
                "step": float(step),
                "learning_rate": learning_rate,
                "train_mean_nll": mean_nll(fwd_bwd_result, batch),
                "num_tokens": float(sum(d.model_input.length for d in batch)),
                **(optim_result.metrics or {}),
                "time_total": time.time() - start,
            }
            logger.info("step %d: %s", step, metrics)
            history.append(metrics)
        final = training_client.save_weights_for_sampler("final").result()
        logger.info("sampler weights: %s", final.path)
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
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--lora-rank", type=int, default=defaults.lora_rank)
    args = parser.parse_args(argv)
    return Config(
        base_model=args.base_model,
        base_url=args.base_url,
        num_steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lora_rank=args.lora_rank,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    main(parse_args())
