"""Do the seed's games learn on SmolLM2-135M on this machine? ``skytrain demo --task`` per seed.

Runs ``skytrain demo --task TASK`` once per task and seed (each in a fresh home under a
temporary directory, one after the other so they do not share the CPU), with any extra
arguments passed on (the recipe: steps, groups, learning rate). For each run it prints the
held-out eval reward (the shaped one the demo trains on) and the game's own score
(``eval_score``) at step 0 and at the last step, the best step's score, and the training wall
time (setup and worker start excluded), with the machine's CPUs and load. Into
``--results`` (bench/results/ by default) it writes each run's table
(``games-TASK-seedN.csv``) and one PNG per task: the held-out reward and score per step, one
line per seed.

With ``--replot`` it runs nothing and draws the PNGs again from the tables already in
``--results`` (for seeds run by separate invocations, side by side, or on other machines:
``--subtitle`` then says which); a ``nan`` in a table is a value not recorded, left out of
the curve.

Usage:
    .venv/bin/python bench/games.py --tasks tic-tac-toe --seeds 0 [-- --steps 8]
    .venv/bin/python bench/games.py --tasks tic-tac-toe --seeds 0 1 2 --replot
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine

TRAINING_TIME_RE = re.compile(r"training took ([0-9.]+) min")
RESULTS = Path(__file__).resolve().parent / "results"


def run(task: str, seed: int, extra: list[str], root: Path, results: Path) -> list[dict[str, str]]:
    home, out = root / f"home-{task}-{seed}", root / f"out-{task}-{seed}"
    command = [sys.executable, "-m", "skytrain_backend", "demo", "--home", str(home)]
    command += ["--task", task, "--seed", str(seed), "--output-dir", str(out), *extra]
    # The demo's output goes to a log in the run's directory, to follow it while it runs.
    log = root / f"{task}-{seed}.log"
    print(f"  {task} seed {seed}: log {log}", flush=True)
    with open(log, "w") as handle:
        returncode = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
    output = log.read_text()
    if returncode != 0:
        raise SystemExit(f"{task} seed {seed} failed:\n{output[-6000:]}")
    shutil.copy(out / "rewards.csv", results / f"games-{task}-seed{seed}.csv")
    rows = read_rows(out / "rewards.csv")
    minutes = TRAINING_TIME_RE.search(output)
    rows[-1]["minutes"] = minutes.group(1) if minutes else "nan"
    return rows


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def plot(task: str, runs: dict[int, list[dict[str, str]]], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axes, score_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, rows in runs.items():
        steps = [int(row["step"]) for row in rows]
        reward_axes.plot(
            steps, [float(r["eval_reward"]) for r in rows], marker="o", label=f"seed {seed}"
        )
        score_axes.plot(
            steps, [float(r["eval_score"]) for r in rows], marker="o", label=f"seed {seed}"
        )
    reward_axes.set(title="held-out shaped reward (trained on)", xlabel="step")
    score_axes.set(title="held-out game score (the game's own)", xlabel="step")
    for axes in (reward_axes, score_axes):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(f"skytrain demo --task {task}, SmolLM2-135M-Instruct\n{subtitle}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["tic-tac-toe", "2048", "temporal-clue"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--replot", action="store_true", help="only draw the PNGs from the tables in --results"
    )
    parser.add_argument(
        "--subtitle",
        help="with --replot: the figure's second line (default: this machine and the arguments)",
    )
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for skytrain demo")
    args = parser.parse_args()
    extra = [arg for arg in args.extra if arg != "--"]
    args.results.mkdir(parents=True, exist_ok=True)
    hardware = f"{machine.cpu_name()}, {os.cpu_count()} CPUs"
    if args.replot:
        for task in args.tasks:
            tables = {
                seed: read_rows(args.results / f"games-{task}-seed{seed}.csv")
                for seed in args.seeds
            }
            subtitle = args.subtitle or f"{hardware}; {' '.join(extra) or 'demo defaults'}"
            plot(task, tables, args.results / f"games-{task}.png", subtitle)
        return
    print(f"{hardware}; demo arguments: {' '.join(extra) or '(defaults)'}", flush=True)
    print(
        "task           seed  reward@0  reward@last  score@0  score@last  best score"
        "  train min  load",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="skytrain-games-bench-") as root:
        for task in args.tasks:
            runs: dict[int, list[dict[str, str]]] = {}
            for seed in args.seeds:
                load_before, started = os.getloadavg()[0], time.monotonic()
                rows = runs[seed] = run(task, seed, extra, Path(root), args.results)
                load = (load_before + os.getloadavg()[0]) / 2
                first, last = rows[0], rows[-1]
                best = max(float(row["eval_score"]) for row in rows[1:] or rows)
                print(
                    f"{task:<13}  {seed:>4}  {float(first['eval_reward']):>8.3f}"
                    f"  {float(last['eval_reward']):>11.3f}  {float(first['eval_score']):>7.3f}"
                    f"  {float(last['eval_score']):>10.3f}  {best:>10.3f}"
                    f"  {float(last['minutes']):>9.1f}  {load:>4.1f}"
                    f"   ({(time.monotonic() - started) / 60:.1f} min with setup)",
                    flush=True,
                )
            subtitle = f"{hardware}; {' '.join(extra) or 'demo defaults'}"
            plot(task, runs, args.results / f"games-{task}.png", subtitle)


if __name__ == "__main__":
    main()
