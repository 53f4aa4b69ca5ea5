"""``skytrain demo`` from start to finish: base model, control plane, training, report, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

import skytrain
from skytrain_backend import hub
from skytrain_backend.base_models import is_hub_id
from skytrain_backend.demo import report
from skytrain_backend.demo.service import EmbeddedService, embedded_service
from skytrain_backend.demo.tasks import DemoTask
from skytrain_backend.demo.training import LoopOptions, StepRow, train

PROJECT = "demo"


@dataclass(frozen=True)
class DemoOptions:
    loop: LoopOptions
    task: DemoTask[Any]
    base_model: str
    home: Path
    output_dir: Path | None
    port: int | None
    model_cache_dir: Path


@dataclass(frozen=True)
class DemoResult:
    rows: list[StepRow]
    plot_path: Path
    csv_path: Path
    training_seconds: float


def say(message: str) -> None:
    print(message, flush=True)


def dashboard_link(service: EmbeddedService) -> str:
    """The dashboard's address with a sign-in link: the page stores the key and drops it from
    the address (a URL fragment never reaches the server)."""
    return f"{service.url}/#key={service.api_key}"


def prepare_base_model(base_model: str, cache_dir: Path) -> None:
    """Convert a GGUF-packaged base model once, here, where its progress bars can be seen.

    Any other name is left to the worker: a local directory, or a Hugging Face id it
    downloads.
    """
    if Path(base_model).expanduser().is_dir():
        return
    if (hub.cache_path(base_model, cache_dir) / "config.json").is_file():
        say(
            f"==> base model {base_model}: converted copy in {hub.cache_path(base_model, cache_dir)}"
        )
        return
    if base_model not in hub.GGUF_SOURCES:
        say(f"==> base model {base_model}: the worker fetches it from the Hugging Face Hub")
        return
    say(f"==> converting {base_model} from its GGUF file into {cache_dir} (once; under a minute)")
    started = time.monotonic()
    path = hub.convert_gguf_model(base_model, cache_dir=cache_dir)
    say(f"    done in {time.monotonic() - started:.0f} s: {path}")


async def _train_model(
    service: EmbeddedService, options: DemoOptions
) -> tuple[list[StepRow], float]:
    """Register the model (waiting for its worker), then train it: rows and training time."""
    loop, task = options.loop, options.task
    columns = task.columns
    # One model per run, named after its base model: a new run starts from the base again.
    name = f"{Path(options.base_model).name.lower()}-{datetime.now():%Y%m%d-%H%M%S}"
    async with skytrain.Backend(base_url=service.url, api_key=service.api_key) as backend:
        model = skytrain.TrainableModel(
            name=name,
            project=PROJECT,
            base_model=options.base_model,
            config=skytrain.ModelConfig(max_seq_length=1024),
        )
        say(f"==> registering {PROJECT}/{name} on {options.base_model}; a worker starts for it")
        await model.register(backend)
        say(
            f"==> training: {loop.steps} steps of {loop.groups_per_step} {task.unit} x "
            f"{loop.rollouts_per_group} rollouts (temperature {loop.temperature:g}, learning rate "
            f"{loop.learning_rate:g}); eval on {loop.eval_questions} held-out "
            f"{task.unit} x {loop.eval_samples} after each step. Task: {task.summary}"
        )
        say(report.header(columns))
        started = time.monotonic()
        rows = await train(
            task, model, loop, on_row=lambda row: say(report.format_row(row, columns))
        )
        seconds = time.monotonic() - started
        # Keep the latest and the best checkpoint by held-out reward; the rest only take disk.
        await model.delete_checkpoints(best_checkpoint_metric="val/reward")
        return rows, seconds


def run_demo(options: DemoOptions) -> DemoResult:
    """Run the whole demo; the control plane and its workers are stopped however it ends."""
    prepare_base_model(options.base_model, options.model_cache_dir)
    # A base model given as a directory: named by its absolute path, and its parent directory
    # allowed on the embedded control plane (which refuses other host paths).
    local = Path(options.base_model).expanduser()
    base_model_dirs: list[Path] = []
    if not is_hub_id(options.base_model) and local.is_dir():
        options = replace(options, base_model=str(local.resolve()))
        base_model_dirs.append(local.resolve().parent)
    say(f"==> starting the embedded control plane (home {options.home})")
    with embedded_service(
        options.home,
        port=options.port,
        model_cache_dir=options.model_cache_dir,
        base_model_dirs=base_model_dirs,
    ) as service:
        say(f"    listening on {service.url}; log: {service.log_path}")
        say(f"    dashboard (open it while the demo runs): {dashboard_link(service)}")
        try:
            rows, training_seconds = asyncio.run(_train_model(service, options))
        except KeyboardInterrupt:
            with contextlib.suppress(httpx.HTTPError):
                if service.cancel_open_jobs():
                    say("==> cancelled the training job in progress")
            raise
        finally:
            say("==> stopping the control plane and its workers")
    output_dir = options.output_dir or options.home / "runs" / datetime.now().strftime(
        "%Y%m%d-%H%M%S"
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    plot_path, csv_path = output_dir / "rewards.png", output_dir / "rewards.csv"
    columns = options.task.columns
    report.write_csv(rows, csv_path, columns)
    report.plot(
        rows,
        plot_path,
        title=f"GRPO on {Path(options.base_model).name}: {options.task.summary}",
    )
    first, last = rows[0], rows[-1]
    say("")
    say(report.table(rows, columns))
    say("")
    say(
        f"held-out eval reward: {first.eval_reward:.3f} at step {first.step} -> "
        f"{last.eval_reward:.3f} at step {last.step} ("
        + ", ".join(
            f"{column.header} {column.format(first.eval_metrics[column.key])} -> "
            f"{column.format(last.eval_metrics[column.key])}"
            for column in columns
        )
        + f"); training took {training_seconds / 60:.1f} min"
    )
    say(f"plot: {plot_path}")
    say(f"table: {csv_path}")
    return DemoResult(
        rows=rows, plot_path=plot_path, csv_path=csv_path, training_seconds=training_seconds
    )
