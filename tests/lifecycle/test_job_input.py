"""A job's input reaches its worker as stored (zstd-compressed JSONL) when the worker takes
zstd, and as plain JSONL otherwise; inputs stored before compression are served as they are."""

from __future__ import annotations

import json

import zstandard

from skytrain_backend.storage import LocalObjectStore, compression, keys
from tests.api.support import group
from tests.lifecycle.conftest import OnWorker, WorkerClient, leased_job


def _raw(worker: WorkerClient, job_id: str, accept: str) -> tuple[str | None, bytes]:
    """The Content-Encoding and the bytes on the wire, undecoded."""
    with worker.http.stream(
        "GET", f"/jobs/{job_id}/input", headers={"Accept-Encoding": accept}
    ) as response:
        assert response.status_code == 200
        assert response.headers["vary"] == "Accept-Encoding"
        return response.headers.get("content-encoding"), b"".join(response.iter_raw())


def test_a_job_input_goes_to_its_worker_compressed_only_if_the_worker_takes_zstd(
    on_worker: OnWorker,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id, group(1.0, 0.0), group(0.5, 0.2, 0.1))

    encoding, wire = _raw(worker, job_id, "gzip, deflate, zstd")
    assert encoding == "zstd" and wire.startswith(compression.MAGIC)
    jsonl = zstandard.ZstdDecompressor().stream_reader(wire).read()
    assert [len(json.loads(line)["trajectories"]) for line in jsonl.splitlines()] == [2, 3]

    assert _raw(worker, job_id, "gzip, deflate") == (None, jsonl)
    assert _raw(worker, job_id, "zstd;q=0") == (None, jsonl)
    # The worker agent's own client (httpx, zstandard installed) decodes it as it reads.
    assert worker.http.get(f"/jobs/{job_id}/input").content == jsonl

    # An input stored before batches were compressed is served as it was stored.
    key = keys.job_input_key(tenant_id=alice.tenant_id, model_id=model_id, job_id=job_id)
    lifecycle_store.put_bytes(key, jsonl)
    assert _raw(worker, job_id, "zstd") == (None, jsonl)
