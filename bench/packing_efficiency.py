"""Packing efficiency: real tokens / row capacity, and tokens saved by sharing group prompts.

A synthetic but agent-shaped batch (seeded): --groups groups of --group-size trajectories; each
group's prompt is 200-2000 tokens (system prompt, tools, task), each completion 20-600 tokens.
Only lengths and shared prefixes matter to packing, so the token ids are random.

For each row length it prints three layouts of the same batch:

- padded: one sequence per row, padded to the longest (what a plain padded batch computes);
- packed: several sequences per row (first-fit decreasing), prompts repeated;
- packed + shared prefixes: each group's prompt stored once per row (skytrain's layout).

"efficiency" is real tokens / (rows x row length); "computed" is the tokens a forward pass
processes (real tokens, padding included for the padded layout).

Usage:
    .venv/bin/python bench/packing_efficiency.py [--groups 16] [--group-size 8]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import machine

from skytrain_backend.trainer.packing import one_sequence_per_row, pack_sequences
from skytrain_backend.trainer.tokenize import TokenizedSequence


def _hardware() -> str:
    return f"{machine.cpu_name()}, {os.cpu_count()} cores (pure Python; no model involved)"


def _batch(groups: int, group_size: int, seed: int) -> list[TokenizedSequence]:
    rng = random.Random(seed)
    sequences = []
    for g in range(groups):
        prompt = [rng.randrange(49152) for _ in range(rng.randint(200, 2000))]
        for t in range(group_size):
            completion = [rng.randrange(49152) for _ in range(rng.randint(20, 600))]
            sequences.append(
                TokenizedSequence(
                    token_ids=prompt + completion,
                    trained=[False] * len(prompt) + [True] * len(completion),
                    logprobs=[math.nan] * (len(prompt) + len(completion)),
                    group_index=g,
                    trajectory_index=t,
                )
            )
    return sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sequences = _batch(args.groups, args.group_size, args.seed)
    real = sum(len(s.token_ids) for s in sequences)
    print(f"hardware: {_hardware()}")
    print(
        f"batch: {args.groups} groups x {args.group_size} trajectories = {len(sequences)} "
        f"sequences, {real} tokens (prompts 200-2000, completions 20-600 tokens, seed {args.seed})"
    )
    header = f"{'row length':>10}  {'layout':<26} {'rows':>5} {'computed':>9} {'efficiency':>10} {'saved by sharing':>17} {'pack time':>9}"
    print(header)
    for row_length in (4096, 8192, 16384):
        start = time.perf_counter()
        padded = one_sequence_per_row(sequences, row_length=row_length)
        elapsed = time.perf_counter() - start
        padded_tokens = len(padded.rows) * max(len(row) for row in padded.rows)
        layouts = [("padded (one per row)", padded, padded_tokens, elapsed)]
        for name, share in (("packed", False), ("packed + shared prefixes", True)):
            start = time.perf_counter()
            packing = pack_sequences(sequences, row_length=row_length, share_prefixes=share)
            elapsed = time.perf_counter() - start
            layouts.append((name, packing, int(packing.stats["packing/real_tokens"]), elapsed))
        for name, packing, computed, elapsed in layouts:
            capacity = computed if packing is padded else packing.stats["packing/capacity_tokens"]
            efficiency = packing.stats["packing/real_tokens"] / capacity
            saved = packing.stats["packing/tokens_saved_by_prefix_sharing"]
            print(
                f"{row_length:>10}  {name:<26} {len(packing.rows):>5} {computed:>9} "
                f"{efficiency:>10.1%} {saved:>17.0f} {elapsed * 1000:>7.1f}ms"
            )


if __name__ == "__main__":
    main()
