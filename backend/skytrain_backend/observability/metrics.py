"""Every Prometheus series skytrain exports, defined in one place.

Names follow Prometheus' conventions: a ``skytrain_`` prefix, base units in the name
(``_bytes``; every histogram of time ends ``_duration_seconds``), ``_total`` on counters and
only on them, no ``_created`` series. Labels take only bounded sets of values: a route's
template (never its path) and its class (a long-poll waits by design: it is kept out of the
in-flight gauge and the request latencies), a status, a tenant *class*, a refusal's reason, a
limit's name. Tenant ids, model ids and base models (strings a tenant chooses) are never
labels.

The series counted as things happen live here; those read from the database when Prometheus
scrapes (jobs by state, the queue, workers and what their heartbeats report) are in
``collector``. Under uvicorn with several processes, ``PROMETHEUS_MULTIPROC_DIR`` makes each
process write its values to files there and the listener add them up (``listener``): gauges
say how they add (``multiprocess_mode``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

# A ``_created`` series per counter and histogram (84 of them) says when the process first
# counted it: noise for every query here, and Prometheus does not need it to compute rates.
disable_created_metrics()

# Request latencies: from a health check (ms) to a long generation (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Training phases and queue waits: seconds to hours.
PHASE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
# Queries and object-store calls: sub-millisecond to tens of seconds.
IO_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30)

# --- HTTP, every route of the control plane -------------------------------------------------

# A route's class: ``request``, answered as soon as it can be, or ``long_poll``, held until
# something happens or its wait ends (workers' leases, Tinker futures, a job's events).
REQUEST, LONG_POLL = "request", "long_poll"

HTTP_REQUESTS = Counter(
    "skytrain_http_requests_total",
    "HTTP requests answered, by method, route template and class, status and tenant class.",
    ["method", "route", "route_class", "status", "tenant_class"],
)
HTTP_DURATION = Histogram(
    "skytrain_http_request_duration_seconds",
    "Time from a request's arrival to its answer's last byte, by route template and class "
    "(a long_poll's includes its wait).",
    ["method", "route", "route_class", "tenant_class"],
    buckets=LATENCY_BUCKETS,
)
HTTP_IN_FLIGHT = Gauge(
    "skytrain_http_requests_in_flight",
    "HTTP requests being answered now, long-polls waiting excepted.",
    multiprocess_mode="livesum",
)
HTTP_LONG_POLLS_WAITING = Gauge(
    "skytrain_http_long_polls_waiting",
    "Long-polls held now, waiting for something to answer.",
    multiprocess_mode="livesum",
)

# --- the inference gateway ------------------------------------------------------------------

GATEWAY_UPSTREAM = Histogram(
    "skytrain_gateway_upstream_duration_seconds",
    "Time from sending a request to a worker's engine to its answer's status line.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
REPLICA_DECISIONS = Counter(
    "skytrain_replica_decisions_total",
    "The scheduler's decisions about model replicas, by kind (scale_out, scale_in, launch, "
    "held, replica_removed, replicas_set, home_moved).",
    ["kind"],
)
MODEL_DEMAND_PER_REPLICA = Gauge(
    "skytrain_model_demand_per_replica",
    "Requests in flight per serving worker (home and replicas), averaged over "
    "SKYTRAIN_REPLICA_WINDOW_S, as the replica policy reads it at each scheduling pass: the "
    "largest (max) and the mean over the placed models (0 when none).",
    ["stat"],
    multiprocess_mode="livemostrecent",  # the leader's scheduler sets it
)
GATEWAY_REPLICA_RETRIES = Counter(
    "skytrain_gateway_replica_retries_total",
    "Requests sent to another replica of their model because the first could not be reached.",
)
GATEWAY_TOKENS = Counter(
    "skytrain_gateway_tokens_total",
    "Tokens through the gateway, as the engines count them: prompt (in) and completion (out).",
    ["direction"],
)
GATEWAY_STREAMS_OPEN = Gauge(
    "skytrain_gateway_streams_open",
    "Streamed answers being relayed now.",
    multiprocess_mode="livesum",
)
GATEWAY_REFUSALS = Counter(
    "skytrain_gateway_refusals_total",
    "Inference requests refused, by reason: the error type answered (rate_limit_error is a "
    "429, unavailable_error a 503...).",
    ["reason", "status"],
)
CONNECTIONS_REFUSED = Counter(
    "skytrain_connections_refused_total",
    "Connections the server closed at its door (connections.py, api/admission/limits.py), by "
    "reason: total_cap (503: SKYTRAIN_MAX_CONNECTIONS), per_client_cap (429: SKYTRAIN_MAX_CONNECTIONS_"
    "PER_CLIENT), header_timeout (408: SKYTRAIN_HEADER_TIMEOUT_S), body_timeout (408 or closed: "
    "SKYTRAIN_REQUEST_BODY_TIMEOUT_S).",
    ["reason"],
)
TENANT_LIMITS_HIT = Counter(
    "skytrain_tenant_limits_hit_total",
    "Requests refused because a tenant reached one of its limits or quotas, by limit.",
    ["limit"],
)

# --- training ---------------------------------------------------------------------------------

JOB_QUEUE_WAIT = Histogram(
    "skytrain_training_queue_wait_duration_seconds",
    "Time a training job waited in the queue before a worker leased it.",
    buckets=PHASE_BUCKETS,
)
JOB_PHASE = Histogram(
    "skytrain_training_phase_duration_seconds",
    "Duration of a training job's phases as its worker reports them (download, prepare, "
    "steps, save, handoff, upload, engine_load) and the control plane's commit.",
    ["phase"],
    buckets=PHASE_BUCKETS,
)
JOBS_ENDED = Counter(
    "skytrain_training_jobs_ended_total",
    "Training jobs that ended, by final status.",
    ["status"],
)
LOGPROB_AGREEMENT = Histogram(
    "skytrain_training_logprob_abs_diff",
    "How far the trainer's logprobs of sampled tokens are from the sampler's, per job, "
    "before its first update: the mean and the largest absolute difference (nats).",
    ["stat"],
    buckets=(0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
OFF_POLICY_STEPS = Histogram(
    "skytrain_training_off_policy_steps",
    "How many steps before the step a job trained from its groups were sampled (the "
    "choices' skytrain_step), per job: the mean and the largest over its groups.",
    ["stat"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
OFF_POLICY_REFUSED = Counter(
    "skytrain_training_groups_refused_off_policy_total",
    "Groups a job left out when it started because they were sampled more than its "
    "max_off_policy_steps before the step it trained from (it was queued behind others).",
)

# --- storage and database ---------------------------------------------------------------------

STORE_DURATION = Histogram(
    "skytrain_object_store_operation_duration_seconds",
    "Object-store calls, by operation and outcome.",
    ["operation", "outcome"],
    buckets=IO_BUCKETS,
)
DB_DURATION = Histogram(
    "skytrain_db_query_duration_seconds",
    "Database statements, by kind (select, insert, update, delete, other).",
    ["statement"],
    buckets=IO_BUCKETS,
)

# What the worker's completion reports as ``time/<phase>_s``.
_PHASE_PREFIX, _PHASE_SUFFIX = "time/", "_s"
_KNOWN_PHASES = frozenset(
    {"download", "prepare", "steps", "save", "handoff", "upload", "engine_load", "training"}
)
_AGREEMENT = {"logprob_agreement/mean_abs_diff": "mean", "logprob_agreement/max_abs_diff": "max"}
_OFF_POLICY = {"off_policy_steps/mean": "mean", "off_policy_steps/max": "max"}
_OFF_POLICY_REFUSED = "groups/refused_off_policy"
_STATEMENTS = frozenset({"select", "insert", "update", "delete"})


def tenant_class(path: str, headers: list[tuple[bytes, bytes]]) -> str:
    """Who a request is from, as a bounded label: ``worker`` (the workers' routes),
    ``tenant`` (a request with a key), ``anonymous`` (health, dashboard assets...)."""
    if path.startswith(("/v1/worker/", "/v1/preview/worker/")):
        return "worker"
    if any(name == b"authorization" for name, _ in headers):
        return "tenant"
    return "anonymous"


def count_usage(content: object) -> None:
    """Count an engine answer's ``usage`` (a whole answer, or a stream's last chunk)."""
    if not isinstance(content, dict):
        return
    usage = content.get("usage")
    if not isinstance(usage, dict):
        return
    for direction, key in (("in", "prompt_tokens"), ("out", "completion_tokens")):
        value = usage.get(key)
        if isinstance(value, int) and value > 0:
            GATEWAY_TOKENS.labels(direction=direction).inc(value)


@contextmanager
def upstream_timer(endpoint: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        GATEWAY_UPSTREAM.labels(endpoint=endpoint).observe(time.perf_counter() - start)


def replica_decided(kind: str) -> None:
    REPLICA_DECISIONS.labels(kind=kind).inc()


def demand_per_replica(values: list[float]) -> None:
    """Set the gauge from one scheduling pass: each placed model's demand per replica."""
    MODEL_DEMAND_PER_REPLICA.labels(stat="max").set(max(values, default=0.0))
    MODEL_DEMAND_PER_REPLICA.labels(stat="mean").set(sum(values) / len(values) if values else 0.0)


def replica_retried() -> None:
    GATEWAY_REPLICA_RETRIES.inc()


def count_refusal(*, path: str, status: int, reason: str) -> None:
    """Count a refused inference request (429, 5xx) by reason: the error type answered."""
    if path.endswith("/completions"):
        GATEWAY_REFUSALS.labels(reason=reason, status=str(status)).inc()


def record_job_completion(metrics: dict[str, float]) -> None:
    """Observe what a worker reported with a job's result: its phases, its agreement and how
    far off-policy its groups were."""
    for key, value in metrics.items():
        if key.startswith(_PHASE_PREFIX) and key.endswith(_PHASE_SUFFIX):
            phase = key[len(_PHASE_PREFIX) : -len(_PHASE_SUFFIX)]
            if phase in _KNOWN_PHASES and value >= 0:
                JOB_PHASE.labels(phase=phase).observe(value)
        elif key in _AGREEMENT and value >= 0:
            LOGPROB_AGREEMENT.labels(stat=_AGREEMENT[key]).observe(value)
        elif key in _OFF_POLICY and value >= 0:
            OFF_POLICY_STEPS.labels(stat=_OFF_POLICY[key]).observe(value)
        elif key == _OFF_POLICY_REFUSED and value > 0:
            OFF_POLICY_REFUSED.inc(value)


T = TypeVar("T")


def timed_phase(phase: str, call: Callable[[], T]) -> T:
    start = time.perf_counter()
    try:
        return call()
    finally:
        JOB_PHASE.labels(phase=phase).observe(time.perf_counter() - start)


def observe_statement(statement: str, seconds: float) -> None:
    kind = statement.lstrip()[:6].lower()
    DB_DURATION.labels(statement=kind if kind in _STATEMENTS else "other").observe(seconds)


_STORE_OPERATIONS = (
    "put_bytes",
    "put_stream",
    "put_file",
    "get_bytes",
    "download_file",
    "copy",
    "exists",
    "list",
    "delete",
    "delete_prefix",
)


def instrument_store(store: Any) -> None:
    """Time the store's calls (``skytrain_object_store_operation_duration_seconds``) on this instance."""
    for name in _STORE_OPERATIONS:
        method = getattr(store, name)
        setattr(store, name, _timed_store_call(name, method))


def _timed_store_call(name: str, method: Callable[..., T]) -> Callable[..., T]:
    def call(*args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        outcome = "error"
        try:
            result = method(*args, **kwargs)
            outcome = "ok"
            return result
        finally:
            STORE_DURATION.labels(operation=name, outcome=outcome).observe(
                time.perf_counter() - start
            )

    return call


def instrument_engine(engine: Any) -> None:
    """Time every statement the SQLAlchemy ``engine`` runs (``skytrain_db_query_duration_seconds``)."""
    from sqlalchemy import event

    # One start per connection: a statement that fails never reaches ``after``, and the next
    # statement's start replaces its own.
    def before(conn: Any, _cursor: Any, _statement: str, *_: Any) -> None:
        conn.info["skytrain_query_start"] = time.perf_counter()

    def after(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        start = conn.info.pop("skytrain_query_start", None)
        if start is not None:
            observe_statement(statement, time.perf_counter() - start)

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
