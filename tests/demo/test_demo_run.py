"""``skytrain demo`` for real, as a user runs it: a process that starts its own control plane
and local worker. A shortened run on SmolLM2 must learn the task (held-out reward up by a clear
margin), print its table, write a valid PNG and leave nothing running; a run interrupted with
Ctrl-C must stop everything too (tiny model: only the shutdown is under test there)."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest

from skytrain_backend.demo import report
from tests.fixtures.models import model_cache_dir

pytestmark = [pytest.mark.e2e]

DEMO_TIMEOUT_S = 1800


def _demo(home: Path, *args: str, stdout: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "SKYTRAIN_MODEL_CACHE_DIR": str(model_cache_dir())}
    return subprocess.Popen(
        [sys.executable, "-m", "skytrain_backend", "demo", "--home", str(home), *args],
        env=env,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _processes_of(home: Path) -> list[int]:
    """Live processes started for this demo home: the server, its workers and their engines."""
    marker = f"SKYTRAIN_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _assert_nothing_left(home: Path) -> None:
    deadline = time.monotonic() + 10  # a killed process may take a moment to be reaped
    while _processes_of(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_of(home) == [], f"processes of {home} still running"


@pytest.mark.slow
def test_a_short_demo_learns_plots_and_stops_everything(tmp_path: Path, smollm2_path: Path) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    # Four steps of half the demo's questions at four times its learning rate: the margin
    # asserted below was 0.24 to 0.32 over seeds 0-2 (README), well clear of 0.15.
    process = _demo(
        home,
        "--steps", "4",
        "--groups-per-step", "4",
        "--rollouts-per-group", "4",
        "--learning-rate", "2e-3",
        "--eval-questions", "8",
        "--output-dir", str(out),
    )  # fmt: skip
    output, _ = process.communicate(timeout=DEMO_TIMEOUT_S)
    assert process.returncode == 0, output[-6000:]

    with open(out / "rewards.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3, 4]
    # The final table was printed: its header and one line per step, with the CSV's numbers
    # (the table shows 3 decimals, the CSV 4: each rounds the same reward on its own).
    lines = output.splitlines()
    last_header = len(lines) - 1 - lines[::-1].index(report.HEADER)
    table = lines[last_header + 1 :][: len(rows)]
    for row, line in zip(rows, table, strict=True):
        step, _train, eval_reward, *_ = line.split()
        assert step == row["step"], line
        assert abs(float(eval_reward) - float(row["eval_reward"])) <= 0.0006, line

    eval_rewards = [float(row["eval_reward"]) for row in rows]
    early, late = sum(eval_rewards[:2]) / 2, sum(eval_rewards[-2:]) / 2
    assert late > early + 0.15, f"held-out reward per step: {eval_rewards}"
    train_rewards = [float(row["train_reward"]) for row in rows[1:]]
    assert train_rewards[-1] > train_rewards[0], f"train reward per step: {train_rewards}"

    plot = out / "rewards.png"
    assert f"plot: {plot}" in output
    height, width, _ = matplotlib.image.imread(plot).shape
    assert width > 400 and height > 300
    _assert_nothing_left(home)


def test_ctrl_c_stops_the_control_plane_its_workers_and_the_open_job(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    home = tmp_path / "home"
    log_path = tmp_path / "demo.out"
    with open(log_path, "w") as log:
        process = _demo(home, "--base-model", str(tiny_model_path), "--steps", "50", stdout=log)
    deadline = time.monotonic() + 600
    # Wait until the worker serves the model and the first training job is under way.
    while "train:" not in log_path.read_text():
        assert process.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.2)
    assert len(_processes_of(home)) >= 3  # the server, a worker and its engine
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=180) == 130
    output = log_path.read_text()
    assert "interrupted: the control plane and its workers are stopped" in output
    _assert_nothing_left(home)
    # No job is left to be picked up by the next demo's worker.
    with contextlib.closing(sqlite3.connect(home / "skytrain.db")) as db:
        statuses = [status for (status,) in db.execute("SELECT status FROM training_jobs")]
    assert statuses and set(statuses) <= {"succeeded", "cancelled"}, statuses
