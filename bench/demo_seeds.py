"""``skytrain demo`` over several seeds: does the task learn reliably, and how long does it take?

Runs the demo once per seed (each in a fresh home under a temporary directory, one after the
other so they do not share the CPU), with any extra arguments passed on, and prints per seed
the held-out eval reward at step 0 and at the last step, the best step, the share of one-word
answers, and the training wall time (setup and worker start excluded), with the machine's
CPU count and load average.

Usage:
    .venv/bin/python bench/demo_seeds.py [--seeds 0 1 2] [-- --steps 8 --learning-rate 1e-3]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine

TRAINING_TIME_RE = re.compile(r"training took ([0-9.]+) min")


def run_seed(seed: int, extra: list[str], root: Path) -> dict[str, float]:
    home, out = root / f"home-{seed}", root / f"out-{seed}"
    command = [sys.executable, "-m", "skytrain_backend", "demo", "--home", str(home)]
    command += ["--seed", str(seed), "--output-dir", str(out), *extra]
    load_before = os.getloadavg()[0]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    with open(out / "rewards.csv") as handle:
        rows = list(csv.DictReader(handle))
    minutes = TRAINING_TIME_RE.search(result.stdout)
    evals = [float(row["eval_reward"]) for row in rows]
    return {
        "first": evals[0],
        "last": evals[-1],
        "best": max(evals),
        "one_word_first": float(rows[0]["eval_one_word"]),
        "one_word_last": float(rows[-1]["eval_one_word"]),
        "correct_first": float(rows[0]["eval_correct"]),
        "correct_last": float(rows[-1]["eval_correct"]),
        "minutes": float(minutes.group(1)) if minutes else float("nan"),
        "load": (load_before + os.getloadavg()[0]) / 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for skytrain demo")
    args = parser.parse_args()
    extra = [arg for arg in args.extra if arg != "--"]
    print(
        f"{machine.cpu_name()}, {os.cpu_count()} CPUs; demo arguments: {' '.join(extra) or '(defaults)'}",
        flush=True,
    )
    print(
        "seed  eval@0  eval@last  best  one-word@0  one-word@last  correct@0  correct@last"
        "  train min  load",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="skytrain-demo-bench-") as root:
        for seed in args.seeds:
            started = time.monotonic()
            r = run_seed(seed, extra, Path(root))
            print(
                f"{seed:>4}  {r['first']:>6.3f}  {r['last']:>9.3f}  {r['best']:>4.2f}"
                f"  {r['one_word_first']:>10.0%}  {r['one_word_last']:>13.0%}"
                f"  {r['correct_first']:>9.0%}  {r['correct_last']:>12.0%}"
                f"  {r['minutes']:>9.1f}  {r['load']:>4.1f}"
                f"   ({(time.monotonic() - started) / 60:.1f} min with setup)",
                flush=True,
            )


if __name__ == "__main__":
    main()
