"""skytrain's settings: the one place that reads the environment.

Every variable has the prefix ``SKYTRAIN_`` (``SKYTRAIN_DATABASE_URL``...). With nothing set,
skytrain runs embedded: SQLite and a local object directory under ``SKYTRAIN_HOME``
(``~/.skytrain``), the ``local`` provider starting workers on this machine.

``Settings`` holds one group per concern (``settings.gateway.default_max_tokens``,
``settings.storage.home``); each group is a pydantic-settings class that reads its own
variables, so the variables' names stay flat (``SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS``,
``SKYTRAIN_HOME``): the group's prefix and the field's name, or the field's
``validation_alias`` where the name is not the prefix's (``SKYTRAIN_ENGINE`` for
``engine.kind``). ``variables()`` lists them all.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ProviderName = Literal["local", "skypilot", "none"]
EngineKind = Literal["auto", "vllm", "hf"]


class _SettingsGroup(BaseSettings):
    """The settings of one concern. Each field is read from its environment variable: the
    group's ``env_prefix`` and the field's name, or the field's ``validation_alias``; keyword
    arguments name the field."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_", extra="forbid", validate_by_name=True)


class StorageSettings(_SettingsGroup):
    """Where state lives: the home, the database, the object store, the model cache."""

    home: Path = Field(
        default=Path("~/.skytrain"),
        description="Directory for the embedded database, objects, worker logs and model cache.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL (postgresql+psycopg://... in production). "
        "Default: SQLite at $SKYTRAIN_HOME/skytrain.db.",
    )
    auto_migrate: bool | None = Field(
        default=None,
        description="Upgrade the schema at start-up. Default: on for SQLite, off otherwise "
        "(run `skytrain db upgrade`).",
    )
    db_pool_size: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Database connections each process keeps open between requests; more are "
        "opened up to the thread count (SKYTRAIN_THREADS) under load, and closed after.",
    )
    object_store_url: str | None = Field(
        default=None,
        description="s3://bucket/prefix or file:///path. Default: file://$SKYTRAIN_HOME/objects.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="Endpoint of an S3-compatible store (MinIO, R2, SeaweedFS...)."
    )
    s3_region: str | None = Field(default=None, description="Region of the S3 bucket.")
    model_cache_dir: Path | None = Field(
        default=None,
        description="Converted local copies of base models. Default: $SKYTRAIN_HOME/models.",
    )
    base_model_dirs: str | None = Field(
        default=None,
        description="Directories, separated by ':', under which tenants may name a base model "
        "by its path; '' for none (Hugging Face ids only). Default: the model cache.",
    )

    @field_validator("home", "model_cache_dir", mode="after")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'skytrain.db'}"

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_database_url.startswith("sqlite")

    @property
    def should_auto_migrate(self) -> bool:
        return self.is_sqlite if self.auto_migrate is None else self.auto_migrate

    @property
    def resolved_object_store_url(self) -> str:
        return self.object_store_url or (self.home / "objects").as_uri()

    @property
    def resolved_model_cache_dir(self) -> Path:
        return self.model_cache_dir or self.home / "models"

    @property
    def resolved_base_model_dirs(self) -> list[Path]:
        if self.base_model_dirs is None:
            return [self.resolved_model_cache_dir]
        return [Path(part).expanduser() for part in self.base_model_dirs.split(":") if part]


class ServerSettings(_SettingsGroup):
    """`skytrain serve`: where it listens, its connections and the requests it takes."""

    host: str = Field(default="127.0.0.1", description="Address `skytrain serve` listens on.")
    port: int = Field(default=8000, description="Port `skytrain serve` listens on.")
    public_url: str | None = Field(
        default=None,
        description="URL workers use to reach the control plane. Default: http://HOST:PORT.",
    )
    keep_alive_s: int = Field(
        default=75,
        ge=1,
        le=3600,
        description="Seconds `skytrain serve` keeps an idle client connection open. Longer "
        "than the clients keep theirs (httpx, under the SDK, the OpenAI and Tinker SDKs and "
        "the workers: 5 s) and than the idle timeout of a load balancer in front (60 s on "
        "most), so it is always the client that closes: a server closing at the moment a "
        "client reuses the connection resets that request.",
    )
    header_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request's headers may take from the connection's accept (or "
        "the first byte after an answer, on a kept-alive one), trickling or not: then 408.",
    )
    max_connections: int = Field(
        default=0,
        ge=0,
        description="Connections `skytrain serve` holds open; more get 503 and are closed. 0: "
        "three quarters of the open-file limit (768 of 1,024), which no value passes.",
    )
    max_connections_per_client: int = Field(
        default=0,
        ge=0,
        description="Connections one client address may hold open; more get 429 and are "
        "closed. 0: half of SKYTRAIN_MAX_CONNECTIONS (behind a proxy: set it to the total).",
    )
    max_requests_per_connection: int = Field(
        default=1000, ge=1, description="Requests one connection carries before it closes."
    )
    request_body_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Longest a client may take to send a request body before it gets 408 "
        "(checkpoint uploads from workers excepted).",
    )
    max_request_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Largest request body accepted."
    )
    max_inference_request_bytes: int = Field(
        default=4 * 1024 * 1024,
        gt=0,
        description="Largest body of an inference request (chat completions, completions): "
        "the prompt's size, before a worker tokenizes it.",
    )
    max_trajectories_per_request: int = Field(
        default=100_000, gt=0, description="Most trajectories in one training job or log call."
    )
    threads: int = Field(
        default=40,
        ge=1,
        le=1000,
        description="Worker threads that run the routes' blocking work (database queries, "
        "object-store calls) at once, per process. The database pool opens up to this many "
        "connections plus those of the control plane's own threads (long-poll checks, "
        "admission counting, the gateway's routing, authentication, the scheduler), so every "
        "thread can hold one at once; on PostgreSQL, max_connections must allow that for "
        "every replica.",
    )

    @property
    def resolved_public_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


class ObservabilitySettings(_SettingsGroup):
    """Logs and the Prometheus metrics listener."""

    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines on stderr: text, or json (one object a line: time, level, "
        "logger, message, request_id, tenant_id, model_id, job_id, worker_id).",
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of the Prometheus metrics listener (`/metrics`), a listener of its "
        "own: the public port never serves metrics. 0 (the default): no listener, so several "
        "control planes on one host never fight over a port; set it (9464 in infra/) where "
        "Prometheus scrapes.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address the metrics listener binds: loopback by default, so only this "
        "host (a Prometheus beside it) reads it; 0.0.0.0 inside a private container network.",
    )
    prometheus_multiproc_dir: Path | None = Field(
        default=None,
        validation_alias="PROMETHEUS_MULTIPROC_DIR",
        description="prometheus_client's own variable (no SKYTRAIN_ prefix): with several "
        "server processes, a directory (emptied before start) where each writes its values "
        "for the listener to add up.",
    )


class AdmissionSettings(_SettingsGroup):
    """Admission of REST and worker requests, and of failed authentications."""

    rest_admission_wait_s: float = Field(
        default=2.0,
        ge=0,
        le=60,
        description="How long a REST request past its tenant's max_concurrent_rest_requests "
        "waits (holding nothing; in order of arrival) for one of the tenant's requests to "
        "finish before it gets 429.",
    )
    rest_admission_bytes_per_request: int = Field(
        default=1024 * 1024,
        gt=0,
        description="A REST, Tinker or worker request counts 1 plus 1 per started this many "
        "bytes of its declared body (chunked: SKYTRAIN_MAX_REQUEST_BYTES), at most the limit.",
    )
    rest_admission_process_places: int = Field(
        default=32,
        gt=0,
        le=100_000,
        description="REST requests in flight in one control-plane process (long-polls while "
        "they wait excepted) that its tenants share: past them, a tenant holding more than "
        "its share (these places over the tenants with requests in flight) waits like one "
        "past its max_concurrent_rest_requests, then gets 429; a tenant with none in flight "
        "is always let in.",
    )
    worker_max_concurrent_requests: int = Field(
        default=64, gt=0, description="Requests in flight per worker token, per process."
    )
    auth_failures_per_minute: int = Field(
        default=60,
        gt=0,
        description="Failed authentications per client address a minute; past them, 429.",
    )
    auth_failure_cache_ttl_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="How long a key or worker token that failed is refused without a lookup.",
    )


class TenantLimitSettings(_SettingsGroup):
    """Every tenant's limits and quotas, unless `skytrain tenants limits` sets its own
    (``db.tenants.TenantLimits``: the same names)."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_TENANT_")

    max_concurrent_requests: int = Field(
        default=256, gt=0, description="Inference requests in flight per tenant before 429."
    )
    max_concurrent_rest_requests: int = Field(
        default=32,
        gt=0,
        description="REST requests (everything under /v1 but inference and the workers' "
        "routes; long-polls while they wait) in flight per tenant, across every control-plane "
        "process on the database, before 429: keep it below SKYTRAIN_THREADS so one tenant "
        "cannot occupy every thread of a process.",
    )
    max_sequences_in_flight: int = Field(
        default=256,
        gt=0,
        description="Sequences being generated per tenant (n of each request in flight, times "
        "its prompts) before 429.",
    )
    max_tokens_in_flight: int = Field(
        default=1_048_576,
        gt=0,
        description="Tokens per tenant in flight before 429: each request counts its body's "
        "bytes (an upper bound of its prompt tokens) plus n x max_tokens.",
    )
    max_waiting_polls: int = Field(
        default=32,
        gt=0,
        description="Long-polls (a job's events followed with wait_s > 0) a tenant may have "
        "waiting at once in one control-plane process; past them a follow is answered at once, "
        "without waiting.",
    )
    max_models: int = Field(
        default=100, ge=0, description="Models a tenant may own; creating one more is a 403."
    )
    max_storage_bytes: int = Field(
        default=100 * 1024**3,
        ge=0,
        description="Bytes a tenant may hold: checkpoints, trajectory batches (logged and jobs' "
        "inputs), Tinker sessions' metadata and queued operations' payloads. A request that "
        "would store more is a 403; deleting checkpoints or models frees their bytes.",
    )
    max_metadata_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="Bytes (as JSON) of one user_metadata a tenant sends (Tinker sessions, "
        "training runs); a larger one is a 413.",
    )
    max_sessions: int = Field(
        default=256,
        ge=0,
        description="Tinker sessions (ServiceClients) a tenant may have open at once; one more "
        "is a 403. A session ends when its client closes, or SKYTRAIN_TINKER_SESSION_TIMEOUT_S "
        "after its last heartbeat.",
    )
    max_queued_jobs: int = Field(
        default=256,
        ge=0,
        description="RL and SFT training jobs a tenant may have queued or running at once; one "
        "more is a 429 until one ends.",
    )
    max_queued_operations: int = Field(
        default=256,
        ge=0,
        description="Operations (forward_backward, optim_step, saves...) queued and not done "
        "per Tinker training run; one more is a 429 until the worker has done some.",
    )
    max_placed_models: int = Field(
        default=8,
        ge=0,
        description="A tenant's models placed on workers at once; the next one waits (its "
        "requests get 429) until one goes idle.",
    )
    max_workers: int = Field(
        default=2, ge=0, description="Workers a tenant's models may occupy at once."
    )


class GatewaySettings(_SettingsGroup):
    """The inference gateway."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_GATEWAY_")

    default_max_tokens: int = Field(
        default=2048,
        gt=0,
        description="The max_tokens the gateway gives a completion request that sets none "
        "(nor max_completion_tokens), so none generates until the context is full; it counts "
        "per sequence towards its tenant's tokens in flight. A prompt that leaves less room is "
        "refused by the engine, naming the room left.",
    )
    loading_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="How long an inference request waits for its checkpoint to load onto "
        "the worker before answering 503.",
    )
    route_cache_ttl_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How long the gateway reuses a resolved route (key, model -> worker, "
        "step); changes made through this process empty it at once, changes made through "
        "another control plane on the same database are seen within this time. 0: no cache.",
    )


class SchedulerSettings(_SettingsGroup):
    """Scheduling and provisioning: workers, placement, replicas, jobs, clean-up."""

    provider: ProviderName = Field(
        default="local", description="How workers are started: local | skypilot | none."
    )
    max_workers: int = Field(default=2, ge=0, description="Most workers the provider starts.")
    worker_idle_timeout_s: float = Field(
        default=1800.0, gt=0, description="Stop a worker with no models and requests this long."
    )
    model_idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Take a model with no inference request, training job or open Tinker run "
        "this long off its worker: its adapters are unloaded and its place (the worker's "
        "max_models, the tenant's max_placed_models) goes to a model that waits; its next "
        "request places it again. At most worker_idle_timeout_s.",
    )
    replica_window_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="The window over which a model's demand (requests in flight, averaged "
        "over time) is judged before a replica is added or taken away.",
    )
    replica_scale_out_in_flight: float = Field(
        default=4.0,
        gt=0,
        le=10_000,
        description="Add a replica (up to the model's max_replicas) when the model's requests "
        "in flight per replica stay above this over replica_window_s.",
    )
    replica_scale_in_in_flight: float = Field(
        default=1.0,
        ge=0,
        le=10_000,
        description="Take a replica away (down to min_replicas) when the requests in flight "
        "per replica, counted with one replica fewer, stay below this over replica_window_s. "
        "Below replica_scale_out_in_flight (hysteresis).",
    )
    replica_cooldown_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        description="After a model's replicas changed, the least time before they change "
        "again for demand.",
    )
    job_lease_s: float = Field(
        default=60.0, gt=0, description="A training job's lease; the worker renews it."
    )
    job_max_attempts: int = Field(
        default=3, ge=1, description="Times a job is leased before it fails for good."
    )
    job_time_slice_s: float = Field(
        default=300.0,
        ge=0,
        le=30 * 24 * 3600,
        description="A training job that has held its worker this long yields it, at its next "
        "optimizer step, to another tenant's job waiting for that worker; it resumes later "
        "exactly where it stopped. 0: at the next step.",
    )
    worker_launch_backoff_s: float = Field(
        default=300.0,
        ge=0,
        description="After a worker failed to start, wait this long before launching another "
        "for its base model; each further failure in a row doubles the wait.",
    )
    worker_launch_backoff_max_s: float = Field(
        default=3600.0, ge=0, description="The longest wait between two launches that failed."
    )
    worker_launch_max_failures: int = Field(
        default=6,
        ge=1,
        description="Workers for one base model that may fail to start in a row; then no more "
        "are launched until the operator runs `skytrain workers retry BASE_MODEL`.",
    )
    worker_register_deadline_s: float = Field(
        default=2700.0,
        gt=0,
        description="A worker a provider launched that has not registered this long after the "
        "launch failed to start: it is stopped and counts as a failed launch. The default "
        "covers a SkyPilot launch (~5-10 min), pulling the vLLM image (~10 GB: 5-10 min), "
        "setup's pip install (~5 min), downloading a 7B model (15 GB: ~5 min) and vLLM's "
        "start (up to SKYTRAIN_ENGINE_STARTUP_TIMEOUT_S, 15 min).",
    )
    worker_heartbeat_timeout_s: float = Field(
        default=45.0, gt=0, description="A worker silent this long is considered lost."
    )
    sweep_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="How often the scheduler removes what is left behind: files of deleted "
        "checkpoints the store failed to delete, model events past SKYTRAIN_MODEL_EVENTS_KEPT.",
    )
    model_events_kept: int = Field(
        default=200,
        ge=1,
        description="The newest events kept for each model (its replicas' scale decisions "
        "and their reasons: `skytrain models show`, GET /v1/models/{id}/events); older ones "
        "are deleted at each sweep (SKYTRAIN_SWEEP_INTERVAL_S).",
    )
    garbage_interval_s: float = Field(
        default=3600.0,
        gt=0,
        description="How often the scheduler lists the object store for objects no row "
        "refers to (left by a crash or a failed delete) and deletes them, and removes uploads "
        "a stopped process never finished once a day old.",
    )
    garbage_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="Objects no row refers to are deleted only once this old (a row may be "
        "about to refer to a newer one).",
    )

    @property
    def resolved_model_idle_timeout_s(self) -> float:
        """How long a model keeps its place unused: a worker is never stopped for idleness
        while a model on it still counts as in use."""
        return min(self.model_idle_timeout_s, self.worker_idle_timeout_s)

    @property
    def launched_workers_limit(self) -> int | None:
        """``max_workers`` where a provider launches workers (None: ``provider="none"``, where
        every worker is started by hand)."""
        return None if self.provider == "none" else self.max_workers


class TinkerSettings(_SettingsGroup):
    """The Tinker protocol."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_TINKER_")

    session_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A Tinker SDK session that stopped heartbeating this long ends: its "
        "training runs close and their trainers leave their workers. The SDK heartbeats "
        "every 10 s (recorded at most every 10 s): keep it well above 20 s.",
    )
    sample_timeout_s: float = Field(
        default=900.0, gt=0, description="A Tinker sampling request not answered by then fails."
    )


class SkyPilotSettings(_SettingsGroup):
    """The `skypilot` provider."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_SKYPILOT_")

    worker_yaml: Path | None = Field(
        default=None,
        description="SkyPilot task workers are launched from. Default: skytrain's sky/worker.yaml.",
    )
    accelerators: str | None = Field(
        default=None,
        description="Accelerators a worker may get ('L4:1,A10G:1,H100:8'); the provider asks "
        "for the cheapest the memory plan fits the base model on (`skytrain workers plan`). "
        "'none' for CPU-only workers. Default: the task's list.",
    )
    infra: str | None = Field(
        default=None,
        description="Where workers run: a cloud, cloud/region or k8s/context "
        "('aws/us-east-1'). Default: any enabled cloud.",
    )
    num_nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Nodes of one worker (a SkyPilot task's num_nodes), for base models larger "
        "than a node: vLLM's pipeline parallelism across them over Ray, the trainer's torchrun "
        "ranks on all of them. 1: a worker is one node.",
    )
    disk_size_gb: int | None = Field(
        default=None, ge=1, description="Disk of a worker, in GB. Default: the task's."
    )
    use_spot: bool = Field(
        default=False, description="Use spot instances (a preempted worker is replaced)."
    )
    autostop_minutes: int = Field(
        default=10, ge=0, description="Tear a worker's cluster down once idle this long."
    )
    worker_port: int = Field(
        default=8100,
        ge=1,
        le=65535,
        description="Port SkyPilot opens for a worker's front door (HTTPS, engine secret).",
    )
    cluster_prefix: str = Field(
        default="skytrain-",
        pattern=r"^[a-z][a-z0-9-]*-$",
        description="Cluster names start with it; clusters with it that no worker owns are "
        "stopped. One per control plane sharing a SkyPilot API server.",
    )
    status_interval_s: float = Field(
        default=20.0, ge=0, description="Least time between two `sky status` queries."
    )


class HubSettings(_SettingsGroup):
    """The Hugging Face Hub base models' config.json is read from."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_HUB_")

    token: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("SKYTRAIN_HF_TOKEN", "HF_TOKEN"),
        description="Hugging Face token (else HF_TOKEN) for gated base models: the control "
        "plane reads their config.json with it; workers get it as a secret.",
    )
    endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("SKYTRAIN_HF_ENDPOINT", "HF_ENDPOINT"),
        pattern=r"^https?://[^\s]+$",
        description="The Hub (else HF_ENDPOINT; default https://huggingface.co) base models' "
        "config.json is read from.",
    )
    timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Longest a model's creation or a launch waits for a base model's "
        "config.json from the Hub (the fetch goes on in the background).",
    )


class EngineSettings(_SettingsGroup):
    """A worker's inference engine (the control plane plans workers with them too)."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_ENGINE_")

    kind: EngineKind = Field(
        validation_alias="SKYTRAIN_ENGINE",
        default="auto",
        description="Inference engine: auto (vLLM with CUDA, else hf) | vllm | hf.",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0, description="How long a worker waits for its engine's /health."
    )
    sleep_wait_s: float = Field(
        default=300.0,
        ge=0,
        description="Worker: how long the engine's sleep before a job waits for requests in "
        "flight to finish; those still running then are aborted (their clients get an "
        "error to retry) so that no request holds training up for longer.",
    )
    sleep_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Worker: how long putting the engine to sleep (once its requests in flight "
        "ended) or waking it may take: vLLM moves its weights between the GPU and host memory "
        "(seconds for a 7B, a minute or two for a 70B). Past it the job fails with a message "
        "naming this setting.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1024 * 1024,
        description="Context length served (vLLM's --max-model-len). Default: the memory "
        "plan's on CUDA (`skytrain workers plan`), the model's own otherwise.",
    )
    max_loras: int = Field(
        default=4, ge=1, description="vLLM: adapters resident on the GPU at once (--max-loras)."
    )
    max_lora_rank: int = Field(
        default=64,
        ge=1,
        description="Largest LoRA rank a worker's engine loads (vLLM's --max-lora-rank); "
        "models of a higher rank are refused at creation.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="vLLM: share of GPU memory it takes. Default: the memory plan's on CUDA "
        "(0.92 on most GPUs), 0.8 otherwise.",
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="vLLM: GPUs one model is split across. Default: the memory plan's on CUDA "
        "(every GPU of the node that splits its heads evenly), 1 otherwise.",
    )
    pipeline_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="vLLM: nodes one model is split across by layers (a multi-node worker; "
        "vLLM then runs over Ray, which sky/worker.yaml starts). Default: 1.",
    )
    secret: str | None = Field(
        default=None,
        description="Worker: the secret its front door requires on every request (the "
        "control plane sends it), 16 to 128 characters. Default: a fresh random one.",
    )
    vllm_python: str | None = Field(
        validation_alias="SKYTRAIN_VLLM_PYTHON",
        default=None,
        description="vLLM: the Python interpreter that runs it, for a vLLM installed in an "
        "environment of its own (scripts/test-vllm.sh's CPU build). Default: this one.",
    )


class WorkerSettings(_SettingsGroup):
    """A worker: how it joins, what it holds; what the control plane gives the workers it starts."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_WORKER_")

    control_plane_url: str | None = Field(
        validation_alias="SKYTRAIN_CONTROL_PLANE_URL",
        default=None,
        description="Worker: URL of the control plane it joins.",
    )
    token: str | None = Field(
        default=None, description="Worker: the token it registers with (swt-...)."
    )
    base_model: str | None = Field(
        default=None, description="Worker: the base model its engine serves."
    )
    id: str | None = Field(
        default=None,
        max_length=64,
        description="Worker and its engine: the id the control plane gave the worker when it "
        "launched it, on every log line from the first (a worker that joins with a join token "
        "learns its id when it registers).",
    )
    max_models: int = Field(
        default=8, ge=1, description="Worker: most models (LoRA adapters) placed on one worker."
    )
    host: str = Field(
        default="0.0.0.0",
        description="Worker: address its front door (HTTPS, engine secret) listens on.",
    )
    port: int = Field(
        default=8100, ge=0, le=65535, description="Worker: its front door's port; 0: a free one."
    )
    sleep_engine: bool | None = Field(
        default=None,
        description="Worker: put the engine to sleep while a job trains. Default: on with "
        "vLLM where it has sleep mode (it shares the GPU with the trainer), off with the CPU "
        "engine and vLLM's CPU build.",
    )
    unload_wait_s: float = Field(
        default=300.0,
        ge=0,
        description="Worker: how long a model (adapter) no longer placed on it stays loaded "
        "for the requests in flight for it (sent before a replica was taken away, or by "
        "another control plane); it is unloaded as soon as they are answered, and at the "
        "latest after this long (those still running then fail).",
    )
    tinker_max_runs: int = Field(
        default=2,
        ge=0,
        le=64,
        description="Worker: most Tinker training runs it holds in memory at once (each keeps "
        "a trainer, parked whole in host memory between operations); more wait in the queue. "
        "The memory plan counts each in the host memory a worker asks for (about 17 GB for a "
        "7B). 0: no Tinker training runs (creating one is refused), nothing parked.",
    )
    wheel: Path | None = Field(
        default=None,
        description="The skytrain wheel workers install (served to them at "
        "/v1/worker/package); it must be this version. Default: built from this installation.",
    )
    unsloth_python: str | None = Field(
        validation_alias="SKYTRAIN_UNSLOTH_PYTHON",
        default=None,
        description="Worker: the Python interpreter of the Unsloth trainer's own environment "
        "(scripts/unsloth-constraints.txt; sky/worker.yaml builds ~/skytrain-unsloth on a "
        "one-GPU node). Used on CUDA when the trainer runs on one GPU; otherwise, or when it "
        "is missing, the trainer is torch + peft in the worker's own process. Default: "
        "~/skytrain-unsloth/bin/python where it exists.",
    )

    @field_validator("wheel", mode="after")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None


class TrainerSettings(_SettingsGroup):
    """A worker's trainer."""

    model_config = SettingsConfigDict(env_prefix="SKYTRAIN_TRAINER_")

    gradient_checkpointing: bool | None = Field(
        default=None,
        description="Worker: gradient checkpointing for models whose config leaves it unset. "
        "Default: the memory plan's on CUDA (on unless the longest row fits without), off "
        "on CPU.",
    )
    max_row_tokens: int | None = Field(
        default=None,
        ge=16,
        le=1024 * 1024,
        description="Worker: the longest row the trainer packs; longer sequences are cut to it "
        "(counted as truncated tokens). Default: the memory plan's on CUDA, no limit on CPU.",
    )
    device_map: Literal["cuda:0", "auto", "fsdp"] | None = Field(
        default=None,
        description="Worker: where the trainer's weights go on CUDA: cuda:0 (one GPU), auto "
        "(spread over the node's GPUs, layer by layer) or fsdp (trainer_shards processes, the "
        "base sharded over their GPUs). Default: the memory plan's.",
    )
    shards: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Worker: trainer processes (torchrun ranks, one a GPU, across the task's "
        "nodes) the base model is sharded over with FSDP2; 1: the trainer in the worker's own "
        "process. Default: the memory plan's.",
    )
    memory_limit_mb: int | None = Field(
        default=None,
        ge=1,
        description="Worker: most memory one training step's activations may take; a job "
        "whose step needs more fails as out of memory. Default: the GPU's free memory on "
        "CUDA, no limit on CPU.",
    )


class Settings(BaseModel):
    """Configuration of the control plane, the worker and the demo, by concern.

    ``Settings()`` reads every group from the environment. A group given as keyword arguments
    (``Settings(gateway={"default_max_tokens": 64})``) takes those fields from them and the
    rest from the environment, as ``GatewaySettings(default_max_tokens=64)`` would."""

    model_config = ConfigDict(extra="forbid")

    storage: StorageSettings = Field(default_factory=StorageSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    tenant_limits: TenantLimitSettings = Field(default_factory=TenantLimitSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    tinker: TinkerSettings = Field(default_factory=TinkerSettings)
    skypilot: SkyPilotSettings = Field(default_factory=SkyPilotSettings)
    hub: HubSettings = Field(default_factory=HubSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)


def variables() -> dict[str, tuple[str, str]]:
    """Every setting's environment variable, with its group and field:
    ``{"SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS": ("gateway", "default_max_tokens"), ...}``. A
    setting with fallbacks (``HF_TOKEN``) is listed under its first name."""
    found: dict[str, tuple[str, str]] = {}
    for group, holder in Settings.model_fields.items():
        cls = holder.default_factory
        assert isinstance(cls, type) and issubclass(cls, _SettingsGroup)
        for name, field in cls.model_fields.items():
            found[_variable(cls.model_config.get("env_prefix", ""), name, field)] = (group, name)
    return found


def wrong_variables(error: ValidationError) -> list[str] | None:
    """A settings group's validation error as one line per wrong environment variable
    (``SKYTRAIN_METRICS_PORT: Input should be a valid integer...``), never its value (it may be
    a secret); None when ``error`` is not a settings group's."""
    groups = {
        getattr(holder.default_factory, "__name__", None): group
        for group, holder in Settings.model_fields.items()
    }
    group = groups.get(error.title)
    if group is None:
        return None
    names = {field: variable for variable, field in variables().items()}
    lines = []
    for item in error.errors(include_input=False, include_url=False):
        field = str(item["loc"][0]) if item["loc"] else ""
        lines.append(f"{names.get((group, field), f'the {group} settings')}: {item['msg']}")
    return lines


def _variable(prefix: str, name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        alias = alias.choices[0]
    return alias if isinstance(alias, str) else f"{prefix}{name}".upper()


def subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment for a child process: this one's, plus ``extra``."""
    return {**os.environ, **extra}


# What a local worker takes from the control plane's environment: how to run programs, and
# where caches and devices are. Never the control plane's settings (its database URL), nor
# credentials (the worker reaches the database and the store only through the control plane).
_WORKER_ENV_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
        "TEMP", "TMP", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME",
        "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
        "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "TRANSFORMERS_OFFLINE",
        "TORCH_HOME", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    }
)  # fmt: skip
_WORKER_ENV_PREFIXES = ("LC_",)


def worker_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a local worker: the few variables of this one it needs to run
    (``_WORKER_ENV_NAMES``, proxies in either case), plus ``extra`` (its own settings)."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name.upper() in _WORKER_ENV_NAMES or name.startswith(_WORKER_ENV_PREFIXES)
    }
    return {**inherited, **extra}


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
