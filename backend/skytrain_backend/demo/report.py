"""What the demo shows: the per-step table, a CSV of it, and the PNG plot of the rewards."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from skytrain_backend.demo.tasks import TASKS, Column
from skytrain_backend.demo.training import StepRow

ONE_WORD_COLUMNS = TASKS["one-word"].columns


def header(columns: Sequence[Column] = ONE_WORD_COLUMNS) -> str:
    """The table's header: the rewards, one column per task metric, the step's seconds."""
    extra = "".join(f"  {'eval ' + column.header:>13}" for column in columns)
    return f"{'step':>4}  {'train reward':>12}  {'eval reward':>11}{extra}  {'seconds':>7}"


# The one-word task's header (the demo's default task).
HEADER = header()


def format_row(row: StepRow, columns: Sequence[Column] = ONE_WORD_COLUMNS) -> str:
    train = "-" if row.train_reward is None else f"{row.train_reward:.3f}"
    extra = "".join(f"  {column.format(row.eval_metrics[column.key]):>13}" for column in columns)
    return f"{row.step:>4}  {train:>12}  {row.eval_reward:>11.3f}{extra}  {row.seconds:>7.0f}"


def table(rows: Sequence[StepRow], columns: Sequence[Column] = ONE_WORD_COLUMNS) -> str:
    return "\n".join([header(columns), *(format_row(row, columns) for row in rows)])


def write_csv(
    rows: Sequence[StepRow], path: Path, columns: Sequence[Column] = ONE_WORD_COLUMNS
) -> None:
    """One line per step; a task metric ``key`` is the column ``eval_<key>``."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "step",
                "train_reward",
                "eval_reward",
                *(f"eval_{column.key}" for column in columns),
                "seconds",
            ]
        )
        for row in rows:
            writer.writerow(
                [
                    row.step,
                    "" if row.train_reward is None else f"{row.train_reward:.4f}",
                    f"{row.eval_reward:.4f}",
                    *(f"{row.eval_metrics[column.key]:.4f}" for column in columns),
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
