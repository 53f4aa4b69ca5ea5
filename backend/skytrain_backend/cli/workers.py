"""The fleet's commands: ``worker`` (run one), ``workers``, ``jobs`` and ``logs``."""

from __future__ import annotations

import enum
import logging

import typer

from skytrain_backend.cli._common import (
    JSON_OPTION,
    _ago,
    _fail,
    _follow,
    _interruptible,
    _log_to_stderr,
    _output,
    _print_json,
    _session,
    _table,
    _when,
    _worker_cells,
    app,
    command_group,
)


class JobStatusChoice(enum.StrEnum):
    """A training job's status (protocol.worker.JobStatus), as `jobs list --status` takes it."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


workers_app = command_group("workers", "See the workers and manage their join tokens.")
jobs_app = command_group("jobs", "See training jobs.")


@app.command()
def worker(
    control_plane: str | None = typer.Option(
        None, help="URL of the control plane. [default: SKYTRAIN_CONTROL_PLANE_URL]"
    ),
    token: str | None = typer.Option(
        None, help="Worker token to register with. [default: SKYTRAIN_WORKER_TOKEN]"
    ),
    base_model: str | None = typer.Option(
        None, help="Base model the engine serves. [default: SKYTRAIN_WORKER_BASE_MODEL]"
    ),
    engine: str | None = typer.Option(
        None, help="auto (vLLM with CUDA), vllm or hf. [default: SKYTRAIN_ENGINE]"
    ),
    host: str | None = typer.Option(
        None,
        help="Address the worker's front door (HTTPS, engine secret) listens on. "
        "[default: SKYTRAIN_WORKER_HOST, 0.0.0.0]",
    ),
    port: int | None = typer.Option(
        None,
        help="Port of the worker's front door; 0: a free one. [default: SKYTRAIN_WORKER_PORT, 8100]",
    ),
    advertise_url: str | None = typer.Option(
        None,
        help="The front door's URL as the control plane reaches it (https://HOST:PORT). "
        "[default: the address the worker's registration comes from, on --port]",
    ),
    device: str | None = typer.Option(None, help="Trainer device (cuda, cpu). [default: auto]"),
) -> None:
    """Run a worker: start the inference engine (on 127.0.0.1) and the front door the control
    plane reaches it through, join the control plane, serve and train."""
    import asyncio

    from skytrain_backend.config import get_settings
    from skytrain_backend.errors import SkytrainError
    from skytrain_backend.worker.main import WorkerConfig, run_worker

    _interruptible()
    _log_to_stderr()
    settings = get_settings()
    log = logging.getLogger("skytrain_backend.worker")
    try:
        config = WorkerConfig.from_settings(
            settings,
            control_plane_url=control_plane,
            token=token,
            base_model=base_model,
            engine=engine,
            host=host,
            port=port,
            advertise_url=advertise_url,
            device=device,
        )
        asyncio.run(run_worker(config, settings))
    except SkytrainError as exc:
        if settings.observability.log_format == "json":  # the log's last line, as an error
            log.error("the worker stopped: %s", exc.message)
            raise typer.Exit(code=1) from None
        raise _fail(exc.message) from None
    except Exception as exc:
        # A log line with the traceback (an `exception` field in JSON), not a boxed one.
        log.exception("the worker stopped: %s", exc)
        raise typer.Exit(code=1) from None


@workers_app.command("list")
def workers_list(
    all_: bool = typer.Option(
        False, "--all", help="Include every stopped, lost and failed worker."
    ),
    json_: bool = JSON_OPTION,
) -> None:
    """List workers: status, base model, models placed, the address the control plane
    reaches them at, last heartbeat, and the reason for the status. A base model whose last
    worker failed to start shows that worker too: why it failed (SkyPilot's job state and
    log for a failed setup) and when the next is launched."""
    from skytrain_backend.db import workers
    from skytrain_backend.scheduler import placement

    with _session() as session:
        rows, held = [], []
        for row in workers.list_workers(session, include_ended=all_):
            reason = row.status_message or ""
            hold = placement.launch_hold(session, base_model=row.base_model)
            if hold is not None and hold.worker.id == row.id:
                held.append(
                    f"{row.base_model}: its last worker, {row.id}, failed to start (failed "
                    f"launches: {hold.describe(row.base_model)}). Why:\n{reason}"
                )
                reason = f"failed launches: {hold.failures} in a row (why: below)"
            rows.append(
                [
                    *_worker_cells(session, row),
                    row.engine_endpoint or "",
                    _ago(row.last_heartbeat_at),
                    reason,
                ]
            )
    columns = ["id", "provider", "status", "base model", "models", "address", "heartbeat"]
    _output("workers", [*columns, "reason"], rows, as_json=json_)
    if json_:
        return
    # In full below the table, whose columns fold a long log.
    for text in held:
        typer.echo(f"\n{text}")


@workers_app.command("retry")
def workers_retry(
    base_model: str = typer.Argument(..., help="The base model whose workers failed to start."),
) -> None:
    """Launch workers for BASE_MODEL again after they failed to start: the failures in a row
    are forgotten, so the back-off and the limit (SKYTRAIN_WORKER_LAUNCH_MAX_FAILURES) start
    over. Fix the cause first: `skytrain workers list` and `skytrain logs WORKER` say why."""
    from skytrain_backend.scheduler import placement

    with _session() as session:
        worker = placement.retry_launches(session, base_model=base_model)
        if worker is None:
            raise _fail(
                f"no failed launch of {base_model!r} holds workers back: its last worker did "
                "not fail to start (see `skytrain workers list --all`)"
            )
        forgiven = worker.id
    typer.echo(
        f"workers for {base_model} are launched again as soon as a model needs one (the "
        f"failures up to worker {forgiven} are forgotten)"
    )


def _loadable_lora_rank(value: int | None) -> int | None:
    from skytrain_backend.config import get_settings

    largest = get_settings().engine.max_lora_rank
    if value is not None and value > largest:
        raise typer.BadParameter(
            f"{value} is above SKYTRAIN_ENGINE_MAX_LORA_RANK ({largest}), the largest rank a "
            "worker loads: models of that rank are refused at creation"
        )
    return value


@workers_app.command("plan")
def workers_plan(
    base_model: str = typer.Argument(
        ...,
        help="A Hugging Face id (its config.json from the model cache, the Hugging Face "
        "cache, else downloaded alone from the Hub: HF_ENDPOINT, HF_TOKEN), or a model "
        "directory.",
    ),
    gpu: list[str] | None = typer.Option(
        None,
        "--gpu",
        help="GPU type and count per worker, NAME:COUNT (L4:1, H100:8); repeat it to compare. "
        "[default: SKYTRAIN_SKYPILOT_ACCELERATORS, else one of each GPU skytrain knows]",
    ),
    json_: bool = typer.Option(
        False, "--json", help="Print JSON: one object for one --gpu, else a list."
    ),
    context: int | None = typer.Option(
        None,
        min=16,
        max=1024 * 1024,
        help="Context vLLM must serve (max_model_len). [default: SKYTRAIN_ENGINE_MAX_MODEL_LEN, "
        "else the model's own, at most 32768, held 4 times]",
    ),
    lora_rank: int | None = typer.Option(
        None,
        min=1,
        max=512,
        callback=_loadable_lora_rank,
        help="The models' LoRA rank: vLLM's slots and the trainer's LoRA states and "
        "activations are planned at it (models are created at rank 8 unless they say "
        "otherwise); at most SKYTRAIN_ENGINE_MAX_LORA_RANK, the largest a worker loads. "
        "[default: SKYTRAIN_ENGINE_MAX_LORA_RANK]",
    ),
    max_loras: int | None = typer.Option(
        None,
        min=1,
        max=256,
        help="Adapters vLLM holds at once. [default: SKYTRAIN_ENGINE_MAX_LORAS]",
    ),
    row_tokens: int | None = typer.Option(
        None,
        min=16,
        max=1024 * 1024,
        help="Longest training row wanted. [default: SKYTRAIN_TRAINER_MAX_ROW_TOKENS, else the "
        "context]",
    ),
    nodes: int | None = typer.Option(
        None,
        min=1,
        max=64,
        help="Nodes of each --gpu a worker spans: vLLM's pipeline stages, one a node, and the "
        "trainer sharded over every GPU of every node. [default: SKYTRAIN_SKYPILOT_NUM_NODES]",
    ),
) -> None:
    """Show how BASE_MODEL is served and trained on a worker's GPUs: whether it fits and why,
    vLLM's max_model_len, gpu_memory_utilization and tensor_parallel_size, the trainer's
    gradient checkpointing and longest row, host memory and disk, and the arithmetic.

    The SkyPilot provider asks for the cheapest configured GPU that fits, with the plan's host
    memory and disk; a worker on CUDA starts vLLM and the trainer with the plan's numbers."""
    import json

    from skytrain_backend.base_models import is_hub_id
    from skytrain_backend.config import get_settings
    from skytrain_backend.errors import ModelConfigUnavailable
    from skytrain_backend.planning import (
        GPU_TYPES,
        ModelShape,
        UnplannableModel,
        find_model_config,
        parse_gpu,
        plan_worker,
    )
    from skytrain_backend.planning.configs import fetch_hub_config

    settings = get_settings()
    config = find_model_config(base_model, cache_dir=settings.storage.resolved_model_cache_dir)
    if config is None and is_hub_id(base_model):
        token = settings.hub.token
        try:
            config = fetch_hub_config(
                base_model,
                endpoint=settings.hub.endpoint,
                token=token.get_secret_value() if token else None,
                timeout_s=settings.hub.timeout_s,
            )
        except ModelConfigUnavailable as exc:
            raise _fail(exc.message) from None
    if config is None:
        raise _fail(f"no config.json in {base_model}: name a model directory, or a Hugging Face id")
    try:
        shape = ModelShape.from_config(config)
        specs = [
            parse_gpu(item)
            for item in gpu or (settings.skypilot.accelerators or "").split(",")
            if item.strip() and item.strip().lower() != "none"
        ] or [parse_gpu(gpu_type.name) for gpu_type in GPU_TYPES]
    except UnplannableModel as exc:
        raise _fail(f"cannot plan {base_model}: {exc}") from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    unknown = [str(spec) for spec in specs if spec.gpu is None]
    if unknown:
        known = ", ".join(gpu_type.name for gpu_type in GPU_TYPES)
        raise _fail(f"unknown GPU {', '.join(unknown)}: skytrain knows {known}")
    plans = [
        plan_worker(
            shape,
            spec.gpu,
            model=base_model,
            gpu_count=spec.count,
            lora_rank=lora_rank or settings.engine.max_lora_rank,
            max_loras=max_loras or settings.engine.max_loras,
            context=context or settings.engine.max_model_len,
            row_tokens=row_tokens or settings.trainer.max_row_tokens,
            tinker_runs=settings.worker.tinker_max_runs,
            nodes=nodes or settings.skypilot.num_nodes,
        )
        for spec in specs
        if spec.gpu is not None
    ]
    if json_:
        documents = [plan.to_json() for plan in plans]
        typer.echo(json.dumps(documents[0] if gpu and len(gpu) == 1 else documents, indent=2))
        return
    for plan in plans:
        verdict = "fits" if plan.fits else "does not fit"
        where = f"{plan.nodes} nodes of {plan.gpu}" if plan.nodes > 1 else plan.gpu
        typer.echo(f"{base_model} on {where}: {verdict}")
        typer.echo(f"  {plan.reason}")
        if plan.fits:
            typer.echo(
                f"  vLLM: --max-model-len {plan.max_model_len} --gpu-memory-utilization "
                f"{plan.gpu_memory_utilization} --tensor-parallel-size "
                f"{plan.tensor_parallel_size}"
                + (f" --pipeline-parallel-size {plan.nodes}" if plan.nodes > 1 else "")
                + f", sleep level {plan.sleep_level}; trainer: "
                f"{plan.trainer_dtype} on {plan.trainer_device_map}"
                + (
                    f" ({plan.trainer_shards} processes, torchrun + FSDP2)"
                    if plan.trainer_shards > 1
                    else ""
                )
                + ", gradient checkpointing "
                f"{'on' if plan.gradient_checkpointing else 'off'}, rows up to "
                f"{plan.max_row_tokens} tokens; host memory {plan.host_memory_gb} GB, disk "
                f"{plan.disk_gb} GB"
            )
        _table(
            f"{base_model} on {plan.gpu}",
            ["phase", "item", "amount", "how"],
            [[row.phase, row.item, row.value, row.how] for row in plan.rows],
        )


token_app = command_group(
    "token",
    "Join tokens for workers started by hand (`sky launch sky/worker.yaml`).",
    parent=workers_app,
)


@token_app.command("create")
def workers_token_create(
    name: str | None = typer.Option(None, help="A label to recognise the token by."),
    base_model: str | None = typer.Option(
        None, help="Only workers serving this base model may join with it. [default: any]"
    ),
) -> None:
    """Create a join token and print it (the token alone on stdout). It is shown only once."""
    from skytrain_backend.db import worker_tokens

    with _session() as session:
        row, token = worker_tokens.create_join_token(session, name=name, base_model=base_model)
    scope = f"workers for {base_model!r}" if base_model else "workers of any base model"
    typer.echo(f"Created join token {row.id} ({row.prefix}...) for {scope}.", err=True)
    typer.echo("Store it now: it is not shown again.", err=True)
    typer.echo(token)


@token_app.command("list")
def workers_token_list(json_: bool = JSON_OPTION) -> None:
    """List join tokens: id, prefix, label, base model scope, created, last used, revoked (UTC)."""
    from skytrain_backend.db import worker_tokens

    columns = ["id", "prefix", "name", "base model", "created", "last used", "revoked"]
    rows: list[list[str]] = []
    with _session() as session:
        rows.extend(
            [
                row.id,
                f"{row.prefix}...",
                row.name or "",
                row.base_model or "any",
                _when(row.created_at),
                _when(row.last_used_at, "never"),
                _when(row.revoked_at),
            ]
            for row in worker_tokens.list_join_tokens(session)
        )
    _output(None, columns, rows, as_json=json_)


@token_app.command("revoke")
def workers_token_revoke(
    token: str = typer.Argument(..., help="The token's id or its prefix (swj-xxxxxx)."),
) -> None:
    """Revoke a join token: no new worker joins with it (running workers keep their own)."""
    from skytrain_backend.db import worker_tokens

    with _session() as session:
        row = worker_tokens.revoke_join_token(session, id_or_prefix=token.removesuffix("..."))
    typer.echo(f"Revoked join token {row.id} ({row.prefix}...).")


@jobs_app.command("list")
def jobs_list(
    status: JobStatusChoice | None = typer.Option(None, help="Only jobs in this status."),
    limit: int = typer.Option(20, min=1, help="Most recent jobs to show."),
    json_: bool = JSON_OPTION,
) -> None:
    """List the most recent training jobs of every tenant."""
    from sqlalchemy import select

    from skytrain_backend.db.models import Model, TrainingJob

    with _session() as session:
        statement = (
            select(TrainingJob, Model)
            .join(Model, Model.id == TrainingJob.model_id)
            .order_by(TrainingJob.created_at.desc())
            .limit(limit)
        )
        if status is not None:
            statement = statement.where(TrainingJob.status == status.value)
        rows = [
            [
                job.id,
                f"{model.entity}/{model.project}/{model.name}",
                job.kind,
                job.status,
                str(job.attempts),
                "-" if job.result_step is None else str(job.result_step),
                job.worker_id or "-",
                _ago(job.created_at),
                (job.error or "")[:80],
            ]
            for job, model in session.execute(statement)
        ]
    _output(
        "training jobs",
        ["id", "model", "kind", "status", "attempts", "step", "worker", "created", "error"],
        rows,
        as_json=json_,
    )


@jobs_app.command("show")
def jobs_show(
    job_id: str = typer.Argument(..., help="The job's id (see `skytrain jobs list`)."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Print its events as they come, until the job ends."
    ),
    json_: bool = JSON_OPTION,
) -> None:
    """Show a training job (model, status, attempts, worker, error) and its events."""
    import json
    import time

    from sqlalchemy import select

    from skytrain_backend.db.models import Model, TrainingJob, TrainingJobEvent
    from skytrain_backend.protocol.worker import TERMINAL_JOB_STATUSES

    def event_line(event: TrainingJobEvent) -> str:
        data = json.dumps(event.data, sort_keys=True, default=str)
        return f"{event.created_at:%Y-%m-%d %H:%M:%S}  {event.type:<18} {data[:200]}"

    with _session() as session:
        job = session.get(TrainingJob, job_id)
        if job is None:
            raise _fail(f"no training job {job_id!r}: see `skytrain jobs list`")
        model = session.get_one(Model, job.model_id)
        fields = {
            "job": job.id,
            "model": f"{model.entity}/{model.project}/{model.name} ({model.id})",
            "kind": job.kind,
            "status": job.status,
            "attempts": f"{job.attempts} of {job.max_attempts}",
            "step": "-" if job.result_step is None else str(job.result_step),
            "worker": job.worker_id or "-",
            "created": _ago(job.created_at),
            "request id": job.request_id or "-",
            "error": job.error or "",
        }
        query = select(TrainingJobEvent).where(TrainingJobEvent.job_id == job.id)
        events = list(session.scalars(query.order_by(TrainingJobEvent.id)))
        if json_:
            _print_json(
                {
                    **{key.replace(" ", "_"): value for key, value in fields.items()},
                    "events": [
                        {"id": e.id, "type": e.type, "data": e.data, "created_at": e.created_at}
                        for e in events
                    ],
                }
            )
            return
        for key, value in fields.items():
            typer.echo(f"{key:<11} {value}")
        typer.echo("events")
        for event in events:
            typer.echo(event_line(event))
        last = events[-1].id if events else 0
        status = job.status
        while follow and status not in TERMINAL_JOB_STATUSES:
            session.commit()  # a fresh read each time
            time.sleep(1.0)
            for event in session.scalars(
                query.where(TrainingJobEvent.id > last).order_by(TrainingJobEvent.id)
            ):
                typer.echo(event_line(event))
                last = event.id
            status = session.scalars(
                select(TrainingJob.status).where(TrainingJob.id == job_id)
            ).one()
        if follow:
            typer.echo(f"the job ended: {status}")


@app.command()
def logs(
    worker_id: str = typer.Argument(..., help="The worker's id (see `skytrain workers list`)."),
    lines: int = typer.Option(100, "--lines", "-n", help="How many of the last lines to show."),
    follow: bool = typer.Option(
        False,
        "--follow",
        "-f",
        help="Then print new lines as the worker writes them, until Ctrl-C (like `tail -f`).",
    ),
) -> None:
    """Show a worker's log: everything a local worker printed; a SkyPilot worker's launch."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db.models import Worker
    from skytrain_backend.provision.local import log_tail, worker_log_path

    with _session() as session:
        row = session.get(Worker, worker_id)
        if row is None:
            raise _fail(f"no worker {worker_id!r}: see `skytrain workers list --all`")
        provider, cluster = row.provider, row.cluster_name
    path = worker_log_path(get_settings().storage.home / "workers", worker_id)
    if provider == "skypilot" and cluster:
        typer.echo(f"(the worker's own output: `sky logs {cluster}`)", err=True)
    if follow and (provider != "manual" or path.exists()):
        # A local worker's file may not be written yet: waited for.
        waiting = f"waiting for worker {worker_id} to write its log at {path} (Ctrl-C to stop)"
        _follow(path, lines=lines, waiting=waiting)
        return
    text = log_tail(path, lines)
    if text:
        typer.echo(text)
    elif provider != "skypilot" or not cluster:
        where = "on its own host" if provider == "manual" else f"at {path}"
        raise _fail(f"no log for worker {worker_id} {where}")
