"""What the demo shows: the per-step table, a CSV of it, and the PNG plot of the rewards."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from skytrain_backend.demo.training import StepRow

HEADER = (
    f"{'step':>4}  {'train reward':>12}  {'eval reward':>11}  "
    f"{'eval one-word':>13}  {'eval correct':>12}  {'seconds':>7}"
)


def format_row(row: StepRow) -> str:
    train = "-" if row.train_reward is None else f"{row.train_reward:.3f}"
    return (
        f"{row.step:>4}  {train:>12}  {row.eval_reward:>11.3f}  "
        f"{row.eval_one_word:>13.0%}  {row.eval_correct:>12.0%}  {row.seconds:>7.0f}"
    )


def table(rows: Sequence[StepRow]) -> str:
    return "\n".join([HEADER, *(format_row(row) for row in rows)])


def write_csv(rows: Sequence[StepRow], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["step", "train_reward", "eval_reward", "eval_one_word", "eval_correct", "seconds"]
        )
        for row in rows:
            writer.writerow(
                [
                    row.step,
                    "" if row.train_reward is None else f"{row.train_reward:.4f}",
                    f"{row.eval_reward:.4f}",
                    f"{row.eval_one_word:.4f}",
                    f"{row.eval_correct:.4f}",
                    f"{row.seconds:.1f}",
                ]
            )


def plot(rows: Sequence[StepRow], path: Path, *, title: str) -> None:
    """Both reward curves against the step, as a PNG (matplotlib's Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = [(row.step, row.train_reward) for row in rows if row.train_reward is not None]
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    axes.plot(
        [row.step for row in rows],
        [row.eval_reward for row in rows],
        marker="o",
        label="held-out eval reward",
    )
    axes.plot(
        [step for step, _ in trained],
        [reward for _, reward in trained],
        marker=".",
        linestyle="--",
        label="train reward (the step's rollouts)",
    )
    axes.set_xlabel("training step")
    axes.set_ylabel("mean reward")
    axes.set_ylim(0, 1.05)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
