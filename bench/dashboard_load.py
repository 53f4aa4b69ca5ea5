"""How long the dashboard takes in a browser with a long training history and a large batch:
a model with --steps checkpoints (the metrics a training job reports, ~35 per step) and a
logged val batch at each step, plus one batch of --groups x --group-size trajectories with
--tokens sampled tokens each (with logprobs).

Starts `skytrain serve` (SQLite, provider none) as a process; the history's rows are written
straight into its database (what the API would have stored: the page reads them the same way),
the large batch through POST /v1/models/{id}/log. Then headless Chromium (the system's, through
Playwright) loads, each --rounds times: the model's metrics page until every chart is drawn,
the trajectories page of the large batch until every group is listed, and opening one of its
trajectories. Reports the median and worst time of each, and the sizes of what was read.

Usage:
    .venv/bin/python bench/dashboard_load.py [--steps 2000] [--groups 50] [--group-size 8]
        [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import machine
from playwright.sync_api import Browser, sync_playwright

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Checkpoint, TrajectoryBatch, new_id
from skytrain_backend.db.session import create_db_engine, session_factory

SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
TRAINER_METRICS = (
    "loss", "loss/policy", "entropy", "grad_norm", "learning_rate", "clip_ratio/low",
    "clip_ratio/high", "ratio/mean", "train/reward", "train/reward_std", "tokens/trainable",
    "train/num_trainable_tokens", "train/num_sequences", "groups/total", "packing/rows",
    "packing/efficiency", "time/training_s", "train/num_gradient_steps",
)  # fmt: skip


def _history(session_factory_: Any, *, model_id: str, steps: int, rng: random.Random) -> None:
    with session_factory_() as session:
        for step in range(1, steps + 1):
            trend = step / steps
            metrics = {key: rng.random() for key in TRAINER_METRICS}
            metrics["train/reward"] = 0.2 + 0.6 * trend + rng.gauss(0, 0.05)
            session.add(Checkpoint(model_id=model_id, step=step, uri="bench", metrics=metrics))
        for step in range(steps + 1):
            reward = 0.2 + 0.6 * step / steps + rng.gauss(0, 0.05)
            summary = {
                "reward": reward, "reward_std_dev": 0.1, "reward/min": reward - 0.2,
                "reward/max": reward + 0.2, "num_trajectories": 16.0, "num_groups": 2.0,
                "chars": rng.random() * 50,
            }  # fmt: skip
            session.add(
                TrajectoryBatch(
                    id=new_id(),
                    model_id=model_id,
                    split="val",
                    step=step,
                    uri="bench",
                    num_groups=2,
                    num_trajectories=16,
                    metrics=summary,
                )
            )
        session.commit()


def _large_batch(groups: int, size: int, tokens: int, rng: random.Random) -> list[dict[str, Any]]:
    def trajectory(g: int, t: int) -> dict[str, Any]:
        ids = [rng.randrange(50000) for _ in range(tokens)]
        return {
            "messages_and_choices": [
                {"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": f"Question {g}: what is the capital of country {g}?"},
                {
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": " ".join(map(str, ids))},
                    "logprobs": {
                        "content": [
                            {"token": f"token_id:{i}", "logprob": -rng.random() * 5} for i in ids
                        ]
                    },
                },
            ],
            "reward": rng.random(),
            "metrics": {"chars": 10 * t},
        }

    return [{"trajectories": [trajectory(g, t) for t in range(size)]} for g in range(groups)]


def _round(browser: Browser, url: str, key: str, model_id: str, args: Any) -> dict[str, float]:
    """One fresh browser context: the three timings."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(f"localStorage.setItem('skytrain.apiKey', {key!r});")
    page = context.new_page()
    page.set_default_timeout(300_000)
    times = {}

    started = time.perf_counter()
    page.goto(f"{url}/#/models/{model_id}")
    page.locator('[data-chart="reward"] canvas').wait_for()
    page.locator('[data-chart="loss/policy"] canvas').wait_for()
    times["metrics"] = time.perf_counter() - started

    started = time.perf_counter()
    page.goto(f"{url}/#/models/{model_id}/trajectories?split=large&step={args.steps}")
    page.locator(f'.group[data-group="{args.groups - 1}"]').wait_for()
    times["trajectories"] = time.perf_counter() - started

    started = time.perf_counter()
    first = page.locator('.group[data-group="0"] details.trajectory').first
    first.locator("summary").click()
    first.locator(".token").first.wait_for()
    times["open"] = time.perf_counter() - started
    context.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--groups", type=int, default=50)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("no chromium on PATH: run scripts/setup.sh")
    rng = random.Random(0)

    with tempfile.TemporaryDirectory(prefix="dashboard-bench-") as directory:
        home = Path(directory)
        port = machine.free_port()
        env = {
            **os.environ,
            "SKYTRAIN_HOME": str(home),
            "SKYTRAIN_PORT": str(port),
            "SKYTRAIN_PROVIDER": "none",
            "SKYTRAIN_MAX_TRAJECTORIES_PER_REQUEST": "100000",
        }
        key = subprocess.run(
            [SKYTRAIN, "keys", "create", "--tenant", "bench"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with open(home / "serve.log", "wb") as log:
            server = subprocess.Popen([SKYTRAIN, "serve"], env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"{url}/health", timeout=2).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        sys.exit(f"skytrain serve did not start: {home / 'serve.log'}")
                    time.sleep(0.2)
            http = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300
            )
            model_id = http.post(
                "/v1/models", json={"project": "bench", "name": "long-run", "base_model": "x/y"}
            ).json()["id"]
            engine = create_db_engine(
                Settings(storage={"home": home}).storage.resolved_database_url
            )
            _history(session_factory(engine), model_id=model_id, steps=args.steps, rng=rng)
            engine.dispose()
            batch = _large_batch(args.groups, args.group_size, args.tokens, rng)
            logged = http.post(
                f"/v1/models/{model_id}/log",
                json={"trajectory_groups": batch, "split": "large", "step": args.steps},
            )
            logged.raise_for_status()
            history_bytes = len(http.get(f"/v1/models/{model_id}/metrics").content)
            batch_bytes = len(http.get(f"/v1/models/{model_id}/logs/{logged.json()['id']}").content)
            times: dict[str, list[float]] = {"metrics": [], "trajectories": [], "open": []}
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=chromium, args=["--no-sandbox"]
                )
                for _ in range(args.rounds):
                    for name, seconds in _round(browser, url, key, model_id, args).items():
                        times[name].append(seconds)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=30)

    load = os.getloadavg()[0]
    print(
        f"machine: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU, 1-min load {load:.1f}; "
        f"{chromium}"
    )
    print(
        f"history: {args.steps} steps ({len(TRAINER_METRICS)} trainer metrics + a val batch "
        f"each): GET .../metrics {history_bytes / 1e6:.2f} MB, plus the checkpoints in pages "
        f"of 100"
    )
    print(
        f"batch: {args.groups} groups x {args.group_size} trajectories x {args.tokens} "
        f"sampled tokens: GET .../logs/{{id}} {batch_bytes / 1e6:.2f} MB"
    )
    for name, label in (
        ("metrics", "metrics page, every chart drawn"),
        ("trajectories", "trajectories page, every group listed"),
        ("open", "one trajectory opened, tokens shaded"),
    ):
        values = times[name]
        print(
            f"{label}: median {statistics.median(values):.2f} s, worst {max(values):.2f} s "
            f"({args.rounds} rounds)"
        )


if __name__ == "__main__":
    main()
