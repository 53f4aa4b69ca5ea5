"""Training tokens/s of one GRPO step next to a plain forward+backward of the same model and batch.

The batch: --groups groups of --group-size trajectories, each a shared prompt of about
--prompt-tokens tokens and a "sampled" completion of --completion-tokens token ids (random ids
with finite logprobs: the values do not change the cost).

- GRPO step: ``Trainer.prepare_rl`` (tokenize and pack; timed apart) and ``Trainer.run``: one
  forward per packed row (shared prompts stored once, 4D mask), logprobs only at trained tokens
  (chunked over the vocabulary; the same forward pass reads the old logprobs of the sampled
  tokens, as the step runs before any update), clipped loss, backward, AdamW step. A job is one
  optimizer step by default, like the baseline.
- Plain forward+backward: the same peft model on the same sequences, unpacked and right-padded
  in micro-batches of --micro-batch, the usual ``model(input_ids, labels=...)`` causal-LM loss
  (full logits at every position), backward, one AdamW step.

Both are reported as sequence tokens/s: the tokens of every trajectory counted whole (prompt +
completion), divided by the wall time; the ratio is GRPO / plain. The best of --repeats runs.

Usage:
    .venv/bin/python bench/train_throughput.py [--model PATH_OR_ID] [--groups 2] [--group-size 8]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import machine
import torch

from skytrain_backend import hub
from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.tokenize import tokenize_rl_groups

REPO = Path(__file__).resolve().parents[1]
SENTENCE = "The lighthouse keeper wrote down every ship that passed the rocky cape. "


def _hardware() -> str:
    gib = machine.memory_gib()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (
        f"{machine.cpu_name()}, {os.cpu_count()} cores, {gib or 0:.0f} GiB RAM, {gpu}; "
        f"torch threads {torch.get_num_threads()}; load average {load} (shared machine)"
    )


def _groups(args: argparse.Namespace, vocab_size: int, tokenizer: object) -> list[TrajectoryGroup]:
    rng = random.Random(0)
    words_per_token = len(SENTENCE.split()) / len(tokenizer(SENTENCE)["input_ids"])  # type: ignore[operator]
    groups = []
    for g in range(args.groups):
        words = int(args.prompt_tokens * words_per_token)
        prompt_text = f"Scenario {g}. " + " ".join((SENTENCE * (words // 12 + 1)).split()[:words])
        prompt = [{"role": "user", "content": prompt_text}]
        trajectories = []
        for _ in range(args.group_size):
            token_ids = [rng.randrange(100, vocab_size) for _ in range(args.completion_tokens)]
            choice = {
                "message": {"role": "assistant", "content": "..."},
                "logprobs": {
                    "content": [{"token": f"token_id:{t}", "logprob": -8.0} for t in token_ids]
                },
            }
            trajectories.append({"messages_and_choices": [*prompt, choice], "reward": rng.random()})
        groups.append(TrajectoryGroup.model_validate({"trajectories": trajectories}))
    return groups


def _grpo_step(
    trainer: Trainer, groups: list[TrajectoryGroup]
) -> tuple[float, float, dict[str, float]]:
    config = RLTrainConfig(learning_rate=1e-6)
    start = time.perf_counter()
    plan = trainer.prepare_rl(groups, config)
    prepared = time.perf_counter()
    list(trainer.run(plan))
    return prepared - start, time.perf_counter() - prepared, plan.summary


def _plain_step(trainer: Trainer, sequences: list[list[int]], micro_batch: int) -> float:
    model = trainer.policy.model
    model.train()
    device = trainer.policy.device
    pad = 0
    start = time.perf_counter()
    total_tokens = sum(len(ids) for ids in sequences)
    for first in range(0, len(sequences), micro_batch):
        batch = sequences[first : first + micro_batch]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch], device=device)
        mask = torch.tensor(
            [[1] * len(ids) + [0] * (width - len(ids)) for ids in batch], device=device
        )
        labels = input_ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        (loss * sum(len(ids) for ids in batch) / total_tokens).backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=hub.SMOLLM2_ID, help="model id or directory")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    model = hub.resolve_model(args.model, cache_dir=REPO / ".cache" / "models")
    trainer = Trainer.load(model, model_config=ModelConfig())
    tokenizer = trainer.policy.tokenizer
    groups = _groups(args, len(tokenizer), tokenizer)
    sequences = [
        s.token_ids
        for s in tokenize_rl_groups(
            tokenizer, groups, scale_rewards=True, allow_training_without_logprobs=False
        ).sequences
    ]
    sequence_tokens = sum(len(ids) for ids in sequences)

    _plain_step(trainer, [sequences[0][:64]], 1)  # warm-up: the first pass of a process is slow
    grpo_best = plain_best = float("inf")
    prepare_s, summary = 0.0, {}
    for _ in range(args.repeats):
        prepare_s, step_s, summary = _grpo_step(trainer, groups)
        grpo_best = min(grpo_best, prepare_s + step_s)
        plain_best = min(plain_best, _plain_step(trainer, sequences, args.micro_batch))

    grpo_rate, plain_rate = sequence_tokens / grpo_best, sequence_tokens / plain_best
    print(f"hardware: {_hardware()}")
    print(
        f"model: {args.model} on {trainer.policy.device}, LoRA rank {trainer.model_config.lora_rank}"
    )
    print(
        f"batch: {len(sequences)} sequences, {sequence_tokens} tokens "
        f"({summary['tokens/trainable']:.0f} trained); packed into {summary['packing/rows']:.0f} "
        f"row(s) holding {summary['packing/real_tokens']:.0f} tokens "
        f"({summary['packing/tokens_saved_by_prefix_sharing']:.0f} saved by prefix sharing)"
    )
    print(
        f"GRPO step:              {grpo_best:7.2f} s  {grpo_rate:8.1f} sequence tokens/s "
        f"(of which prepare_rl: tokenize, pack {prepare_s:.2f} s)"
    )
    print(f"plain forward+backward: {plain_best:7.2f} s  {plain_rate:8.1f} sequence tokens/s")
    print(f"ratio GRPO / plain: {grpo_rate / plain_rate:.2f}")


if __name__ == "__main__":
    main()
