"""Objects no row refers to are deleted once older than the grace period; every object a row
refers to is kept; writes a stopped process never finished are removed once stale. On each
database and store (listing and deleting is what it tests)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import batches
from skytrain_backend.db.models import Checkpoint, Tenant, TrainingJob, new_id, utcnow
from skytrain_backend.errors import StorageError
from skytrain_backend.scheduler import garbage
from skytrain_backend.storage import ObjectStore
from skytrain_backend.storage import keys as object_keys
from skytrain_backend.storage.local import LocalObjectStore
from skytrain_backend.storage.s3 import MULTIPART_THRESHOLD, S3ObjectStore
from tests.fixtures.rows import add_model, add_rl_job
from tests.fixtures.services import ON_EVERY_BACKEND, ApiKey

pytestmark = ON_EVERY_BACKEND


def test_objects_no_row_refers_to_are_collected_after_the_grace_period(
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
    api_key: Callable[..., ApiKey],
) -> None:
    tenant_id = api_key().tenant_id
    kept: list[str] = []
    collected: list[str] = []

    def put(key: str, *, referenced: bool) -> None:
        object_store.put_bytes(key, b"x")
        (kept if referenced else collected).append(key)

    with db_sessions() as session:
        tenant = session.get_one(Tenant, tenant_id)
        model = add_model(session, new_id(), base_model="base", tenant=tenant.name, project="p")
        model_id = model.id
        prefix = object_keys.model_prefix(tenant_id=tenant_id, model_id=model_id)
        # Step 1 committed; step 2 deleted and purged (its row has no uri); step 3 copied by
        # a commit that never happened; step 5 committed by attempt 2 of a job, whose attempt
        # 1 copied beside it after losing its lease.
        committed = object_store.uri(f"{prefix}checkpoints/1")
        session.add(Checkpoint(model_id=model_id, step=1, uri=committed, metrics={}))
        by_attempt = object_store.uri(f"{prefix}checkpoints/5-j.2")
        session.add(Checkpoint(model_id=model_id, step=5, uri=by_attempt, metrics={}))
        session.add(
            Checkpoint(model_id=model_id, step=2, uri=None, metrics={}, deleted_at=utcnow())
        )
        running = add_rl_job(session, model_id)
        running.status, running.attempts = "running", 2
        batch = batches.add_batch(
            session,
            batch_id=new_id(),
            model_id=model_id,
            split="val",
            step=0,
            uri="x",
            num_groups=1,
            num_trajectories=2,
            metrics={},
        )
        session.commit()
        job_id, batch_id = running.id, batch.id

    put(f"{prefix}checkpoints/1/adapter_model.safetensors", referenced=True)
    put(f"{prefix}checkpoints/2/adapter_model.safetensors", referenced=False)
    put(f"{prefix}checkpoints/3/adapter_model.safetensors", referenced=False)
    put(f"{prefix}checkpoints/5-j.2/adapter_model.safetensors", referenced=True)
    put(f"{prefix}checkpoints/5-j.1/adapter_model.safetensors", referenced=False)
    put(f"{prefix}jobs/{job_id}/input.jsonl", referenced=True)
    put(f"{prefix}jobs/{job_id}/attempts/2/adapter_config.json", referenced=True)  # running
    put(f"{prefix}jobs/{job_id}/attempts/1/adapter_config.json", referenced=False)  # over
    put(f"{prefix}jobs/{new_id()}/input.jsonl", referenced=False)  # its row never came
    put(f"{prefix}logs/{batch_id}.jsonl", referenced=True)
    put(f"{prefix}logs/{new_id()}.jsonl", referenced=False)
    gone_model = object_keys.model_prefix(tenant_id=tenant_id, model_id=new_id())
    put(f"{gone_model}checkpoints/4/adapter_model.safetensors", referenced=False)
    put(object_keys.file_key(tenant_id=tenant_id, file_id=new_id()), referenced=True)

    tenant_prefix = object_keys.tenant_prefix(tenant_id)
    with db_sessions() as session:
        # Within the grace period nothing is touched: a row may be about to refer to it.
        recent = utcnow() - timedelta(hours=1)
        assert garbage.collect_garbage(session, store=object_store, written_before=recent) == 0
        assert sorted(i.key for i in object_store.list(tenant_prefix)) == sorted(kept + collected)

        later = utcnow() + timedelta(minutes=1)
        deleted = garbage.collect_garbage(session, store=object_store, written_before=later)
    assert sorted(i.key for i in object_store.list(tenant_prefix)) == sorted(kept)
    assert deleted >= len(collected)  # other tests' leftovers in the shared store may go too
    with db_sessions() as session:
        assert session.get_one(TrainingJob, job_id).status == "running"  # rows untouched


def test_hub_configs_of_base_models_no_model_names_are_collected(
    db_sessions: sessionmaker[Session], api_key: Callable[..., ApiKey], tmp_path: Path
) -> None:
    """Any tenant may name any Hub repository: the store keeps the configs of base models
    that models name, and the sweep deletes the others once past the grace period."""
    store = LocalObjectStore(tmp_path / "objects")  # its own: the sweep lists all configs
    endpoint = "https://hub.example"
    used, unused = f"org/used-{new_id()}", f"org/unused-{new_id()}"
    with db_sessions() as session:
        tenant = session.get_one(Tenant, api_key().tenant_id)
        add_model(session, new_id(), base_model=used, tenant=tenant.name, project="p")
        session.commit()
    for base_model in (used, unused):
        key = object_keys.hub_config_key(endpoint=endpoint, base_model=base_model)
        store.put_bytes(key, b'{"model_type": "llama"}')

    def configs() -> list[str]:
        return sorted(info.key for info in store.list(object_keys.HUB_CONFIGS_PREFIX))

    everything = configs()
    later = utcnow() + timedelta(minutes=1)
    with db_sessions() as session:
        recent = utcnow() - timedelta(hours=1)
        assert (
            garbage.collect_garbage(
                session, store=store, written_before=recent, hub_endpoint=endpoint
            )
            == 0
        )
        # Without the Hub's address the sweep cannot tell which config is whose: all kept.
        assert garbage.collect_garbage(session, store=store, written_before=later) == 0
        assert configs() == everything
        assert (
            garbage.collect_garbage(
                session, store=store, written_before=later, hub_endpoint=endpoint
            )
            == 1
        )
    assert configs() == [object_keys.hub_config_key(endpoint=endpoint, base_model=used)]


def test_a_write_that_a_stopped_process_never_finished_is_removed_once_stale(
    object_store: ObjectStore, api_key: Callable[..., ApiKey]
) -> None:
    """A streamed write left open (its process killed mid-upload: an S3 multipart upload with
    one part sent, or a local temporary file) is invisible to listing; the sweep removes it
    once it started before the cutoff, and never a finished object or a younger write."""
    prefix = object_keys.model_prefix(tenant_id=api_key().tenant_id, model_id=new_id())
    object_store.put_bytes(f"{prefix}finished.jsonl", b"kept")
    abandoned = object_store.open_writer(f"{prefix}abandoned.jsonl")
    abandoned.write(b"x" * (MULTIPART_THRESHOLD + 1))  # past the threshold: S3 has begun it
    (started,) = _unfinished_writes(object_store, prefix)

    # The store is shared with other tests: only what is under this test's prefix is its own.
    garbage.abort_stale_uploads(object_store, started_before=started)  # not before itself
    assert _unfinished_writes(object_store, prefix) == [started]
    assert garbage.abort_stale_uploads(object_store, started_before=started + ONE_SECOND) >= 1
    assert _unfinished_writes(object_store, prefix) == []

    assert [info.key for info in object_store.list(prefix)] == [f"{prefix}finished.jsonl"]
    # The process, had it lived on, could not finish what the sweep removed.
    with pytest.raises(StorageError):
        abandoned.commit()
    abandoned.abort()
    assert [info.key for info in object_store.list(prefix)] == [f"{prefix}finished.jsonl"]
    object_store.delete_prefix(prefix)


ONE_SECOND = timedelta(seconds=1)


def _unfinished_writes(store: ObjectStore, prefix: str) -> list[datetime]:
    """When each unfinished write under ``prefix`` started, as the store itself reports it
    (each server keeps it at its own precision, SeaweedFS to the second, so the test cannot
    use its own clock)."""
    if isinstance(store, S3ObjectStore):
        uploads = store._client.list_multipart_uploads(
            Bucket=store.bucket, Prefix=f"{store.prefix}/{prefix}" if store.prefix else prefix
        ).get("Uploads", [])
        return [upload["Initiated"] for upload in uploads]
    assert isinstance(store, LocalObjectStore)
    directory = store.root / prefix
    temps = directory.iterdir() if directory.is_dir() else iter(())
    return [
        datetime.fromtimestamp(path.stat().st_mtime, UTC)
        for path in temps
        if path.name.startswith(".tmp-")
    ]
