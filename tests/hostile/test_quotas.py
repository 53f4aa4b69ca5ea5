"""Quotas that cannot be raced, and bounds on what a tenant stores (issue 38, items 3 and 4).

Through the clients a tenant uses: REST over httpx, and the official ``tinker`` SDK's own
request methods (``AsyncTinker``, the client ``ServiceClient`` sends through: each call is one request, so 64 of them really are in flight
at once, and a refused one raises at once rather than waiting for a worker). The control
plane runs in this process (uvicorn on loopback, provider ``none``: no worker, so queued
operations stay queued), on SQLite and on PostgreSQL, since counting under a lock is what is
tested.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from tinker._client import AsyncTinker
from typer.testing import CliRunner

import tinker
from skytrain_backend.app import create_app
from skytrain_backend.cli import app as cli_app
from skytrain_backend.config import Settings, get_settings
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db.models import Model, TinkerRequest, TinkerSession
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.storage import ObjectWriter, keys, open_object_store
from skytrain_backend.storage.local import LocalObjectStore
from tests.api import support
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread
from tinker import types

HUB_MODEL = "tests-org/tiny-model"
CONCURRENT = 64


@dataclass(frozen=True)
class Plane:
    url: str
    settings: Settings
    sessions: sessionmaker[Session]
    app: FastAPI


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def plane(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    make_settings: MakeSettings,
) -> Iterator[Plane]:
    home = tmp_path_factory.mktemp(f"quotas-{request.param}")
    # The process's shared REST places (32) refused part of a 64-request race on a slow
    # machine before any quota was counted: there are more than the race needs, and no wait
    # (an admission refusal would show at once, on any machine, rather than after 2 s).
    settings = make_settings(
        database=request.param,
        storage={"home": home, "model_cache_dir": home / "models"},
        admission={"rest_admission_process_places": 4 * CONCURRENT, "rest_admission_wait_s": 0},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield Plane(url=url, settings=settings, sessions=session_factory(engine), app=app)
    engine.dispose()


@dataclass(frozen=True)
class Who:
    name: str
    key: str
    plane: Plane

    def rest(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.plane.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120
        )

    def tinker(self, *, max_retries: int = 2) -> AsyncTinker:
        return AsyncTinker(
            base_url=self.plane.url, api_key="tml-" + self.key, max_retries=max_retries
        )

    def count(self, table: Any) -> int:
        """The tenant's rows in ``table`` (a model class with a ``tenant_id``)."""
        with self.plane.sessions() as session:
            tenant = tenants.get_tenant_by_name(session, name=self.name)
            return int(
                session.scalar(select(func.count()).where(table.tenant_id == tenant.id)) or 0
            )

    def models(self) -> int:
        return self.count(Model)

    def objects(self) -> list[str]:
        """The keys of the tenant's objects in the store."""
        with self.plane.sessions() as session:
            tenant_id = tenants.get_tenant_by_name(session, name=self.name).id
        store = open_object_store(
            self.plane.settings.storage.resolved_object_store_url, self.plane.settings
        )
        return [info.key for info in store.list(keys.tenant_prefix(tenant_id))]

    def stored_bytes(self) -> int:
        with self.plane.sessions() as session:
            tenant = tenants.get_tenant_by_name(session, name=self.name)
            return tenants.usage_of(session, tenant_id=tenant.id).storage_bytes


@pytest.fixture
def tenant(plane: Plane) -> Callable[..., Who]:
    """``tenant(**limits)``: a new tenant with those limits (no REST admission in the way of
    the concurrent requests: neither its own cap nor the process's places)."""

    def make(**limits: int) -> Who:
        name = f"q-{uuid.uuid4().hex[:10]}"
        with plane.sessions() as session:
            _, key = api_keys.create_key(session, tenant_name=name)
            values = {"max_concurrent_rest_requests": 4 * CONCURRENT, **limits}
            tenants.set_limits(session, tenant_name=name, values=values, reset=[])
        return Who(name=name, key=key, plane=plane)

    return make


def _model(http: httpx.Client) -> Any:
    """A model made over REST by ``http``'s tenant: the answer's body."""
    return http.post(
        "/v1/models", json={"project": "p", "name": "m", "base_model": HUB_MODEL}
    ).json()


async def _session(client: AsyncTinker, **fields: Any) -> str:
    request = types.CreateSessionRequest(
        tags=[], user_metadata=fields.pop("user_metadata", None), sdk_version="test", **fields
    )
    return (await client.service.create_session(request=request)).session_id


def _race_in_one_session(
    who: Who, request: Callable[[AsyncTinker, str, int], Awaitable[Any]]
) -> list[Any]:
    """``CONCURRENT`` calls of ``request(client, session_id, i)`` at once in one Tinker
    session: what each returned or raised."""

    async def race() -> list[Any]:
        async with who.tinker() as client:
            session_id = await _session(client)
            return await asyncio.gather(
                *(request(client, session_id, i) for i in range(CONCURRENT)),
                return_exceptions=True,
            )

    return asyncio.run(race())


def _assert_two_made_and_the_rest_refused_by_max_models(
    who: Who, outcomes: list[Any], made: type
) -> None:
    created = [o for o in outcomes if isinstance(o, made)]
    assert len(created) == 2
    for outcome in outcomes:
        if outcome not in created:
            assert isinstance(outcome, tinker.PermissionDeniedError), outcome
            assert "(2)" in str(outcome) and "--max-models" in str(outcome)
    assert who.models() == 2


# --- quotas enforced atomically -----------------------------------------------------------------


def test_concurrent_rest_creates_make_exactly_max_models(tenant: Callable[..., Who]) -> None:
    who = tenant(max_models=2)
    with who.rest() as http, ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(
            pool.map(
                lambda i: http.post(
                    "/v1/models", json={"project": "race", "name": f"m{i}", "base_model": HUB_MODEL}
                ),
                range(CONCURRENT),
            )
        )
    created = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(created) == 2
    for answer in refused:
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["type"] == "quota_exceeded"
        assert "(2)" in answer.json()["error"]["message"]
    assert who.models() == 2


def test_concurrent_tinker_create_model_makes_exactly_max_models(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_models=2)

    def create(client: AsyncTinker, session_id: str, i: int) -> Awaitable[Any]:
        return client.models.create(
            request=types.CreateModelRequest(
                session_id=session_id,
                model_seq_id=i,
                base_model=HUB_MODEL,
                lora_config=types.LoraConfig(rank=8),
            )
        )

    outcomes = _race_in_one_session(who, create)
    _assert_two_made_and_the_rest_refused_by_max_models(who, outcomes, types.UntypedAPIFuture)


def test_concurrent_tinker_sampling_sessions_make_exactly_max_models(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_models=2)

    def open_sampling(client: AsyncTinker, session_id: str, i: int) -> Awaitable[Any]:
        return client.service.create_sampling_session(
            request=types.CreateSamplingSessionRequest(
                session_id=session_id, sampling_session_seq_id=i, base_model=f"{HUB_MODEL}-{i}"
            )
        )

    outcomes = _race_in_one_session(who, open_sampling)
    _assert_two_made_and_the_rest_refused_by_max_models(
        who, outcomes, types.CreateSamplingSessionResponse
    )


def test_concurrent_tinker_sessions_make_exactly_max_sessions_and_a_finished_one_frees_its_place(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_sessions=2)

    async def race() -> list[Any]:
        async with who.tinker(max_retries=0) as client:
            return await asyncio.gather(
                *(_session(client) for _ in range(CONCURRENT)), return_exceptions=True
            )

    outcomes = asyncio.run(race())
    opened = [o for o in outcomes if isinstance(o, str)]
    assert len(opened) == 2
    for outcome in outcomes:
        if outcome not in opened:
            assert isinstance(outcome, tinker.PermissionDeniedError), outcome
            assert "2 Tinker sessions open" in str(outcome) and "--max-sessions" in str(outcome)
    assert who.count(TinkerSession) == 2

    # The SDK finishes its session when the ServiceClient closes: its place is free again.
    with httpx.Client(
        base_url=who.plane.url, headers={"X-API-Key": "tml-" + who.key}, timeout=60
    ) as http:
        finished = http.post(f"/api/v1/sessions/{opened[0]}/finish", json={"reason": {}})
        assert finished.status_code == 204, finished.text

    async def another() -> str:
        async with who.tinker(max_retries=0) as client:
            return await _session(client)

    assert asyncio.run(another())


def test_concurrent_training_jobs_queue_exactly_max_queued_jobs(tenant: Callable[..., Who]) -> None:
    who = tenant(max_queued_jobs=2)
    with who.rest() as http:
        model = _model(http)
        body = {"model_id": model["id"], "trajectory_groups": [support.group()]}
        with ThreadPoolExecutor(CONCURRENT // 2) as pool:
            answers = list(
                pool.map(
                    lambda _: http.post("/v1/training-jobs", json=body), range(CONCURRENT // 2)
                )
            )
        queued = [a for a in answers if a.status_code == 201]
        assert len(queued) == 2
        for answer in answers:
            if answer not in queued:
                assert answer.status_code == 429, answer.text
                assert "Retry-After" in answer.headers
                assert "max_queued_jobs, 2" in answer.json()["error"]["message"]
        listed = http.get("/v1/training-jobs", params={"model_id": model["id"]}).json()["data"]
        assert sorted(job["id"] for job in listed) == sorted(a.json()["id"] for a in queued)
    shown = _skytrain(who, "tenants", "show", who.name).splitlines()
    assert [line.split()[1:3] for line in shown if line.startswith("max_queued_jobs")] == [
        ["2", "2"]
    ]
    # The refused jobs' inputs were deleted: two are in the store.
    assert len([key for key in who.objects() if "/jobs/" in key]) == 2


# --- what a tenant stores -----------------------------------------------------------------------


def test_a_60_mb_user_metadata_is_refused_with_its_limit_and_nothing_stored(
    tenant: Callable[..., Who],
) -> None:
    who = tenant()
    limit = who.plane.settings.tenant_limits.max_metadata_bytes

    async def attempt() -> None:
        async with who.tinker(max_retries=0) as client:
            with pytest.raises(tinker.APIStatusError) as refused:
                await _session(client, user_metadata={"blob": "x" * 60_000_000})
            assert refused.value.status_code == 413
            message = str(refused.value)
            assert f"max_metadata_bytes ({limit})" in message
            assert "--max-metadata-bytes" in message
            # A training run's metadata has the same cap.
            session_id = await _session(client, user_metadata={"run": "small"})
            with pytest.raises(tinker.APIStatusError, match="max_metadata_bytes") as too_big:
                await client.models.create(
                    request=types.CreateModelRequest(
                        session_id=session_id,
                        model_seq_id=0,
                        base_model=HUB_MODEL,
                        user_metadata={"blob": "x" * (limit + 1)},
                        lora_config=types.LoraConfig(rank=8),
                    )
                )
            assert too_big.value.status_code == 413

    asyncio.run(attempt())
    assert who.count(TinkerSession) == 1  # the small one only
    assert who.models() == 0


def _datum(length: int) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([1] * length),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[2] * length, dtype="int64"),
            "weights": types.TensorData(data=[1.0] * length, dtype="float32"),
        },
    )


def _forward_backward(run_id: str, seq_id: int, *, length: int = 3) -> types.ForwardBackwardRequest:
    return types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum(length)], loss_fn="cross_entropy"
        ),
        model_id=run_id,
        seq_id=seq_id,
    )


def test_operations_past_the_runs_queue_cap_are_refused(tenant: Callable[..., Who]) -> None:
    who = tenant(max_queued_operations=3)

    async def attempt() -> None:
        async with who.tinker(max_retries=0) as client:
            run_id = await _run(client)
            # The creation is the run's first operation; no worker does any of them here.
            for seq_id in (1, 2):
                await client.training.forward_backward(request=_forward_backward(run_id, seq_id))
            with pytest.raises(tinker.RateLimitError) as refused:
                await client.training.forward_backward(request=_forward_backward(run_id, 3))
            message = str(refused.value)
            assert "3 operations queued" in message and "max_queued_operations, 3" in message
            assert "--max-queued-operations" in message
            # Any kind of operation: an optimizer step too.
            with pytest.raises(tinker.RateLimitError, match="max_queued_operations"):
                await client.training.optim_step(
                    request=types.OptimStepRequest(
                        adam_params=types.AdamParams(learning_rate=1e-4),
                        model_id=run_id,
                        seq_id=3,
                    )
                )

    asyncio.run(attempt())
    assert who.count(TinkerRequest) == 3
    # The refused operation's payload is not in the store: two forward_backward inputs are.
    assert len([key for key in who.objects() if key.endswith("/input.pb")]) == 2


async def _run(client: AsyncTinker) -> str:
    session_id = await _session(client)
    created = await client.models.create(
        request=types.CreateModelRequest(
            session_id=session_id,
            model_seq_id=0,
            base_model=HUB_MODEL,
            lora_config=types.LoraConfig(rank=8),
        )
    )
    assert created.model_id is not None
    return created.model_id


def test_an_operation_over_the_storage_quota_fails_and_the_runs_next_ones_still_queue(
    tenant: Callable[..., Who],
) -> None:
    # 1,000 tokens: a forward_backward body of about 16 kB, so one fits and two do not.
    who = tenant(max_storage_bytes=30_000)

    async def attempt() -> list[types.UntypedAPIFuture]:
        async with who.tinker(max_retries=0) as client:
            run_id = await _run(client)
            return [
                await client.training.forward_backward(
                    request=_forward_backward(run_id, seq_id, length=length)
                )
                for seq_id, length in ((1, 1_000), (2, 1_000), (3, 3))
            ]

    first, over, after = asyncio.run(attempt())
    with who.plane.sessions() as session:
        rows = {
            r.id: r for r in session.scalars(select(TinkerRequest).where(TinkerRequest.seq_id > 0))
        }
    # Its future fails naming the quota (a 403 would leave a gap the run's next operations
    # wait behind for ever); the others are queued.
    assert rows[over.request_id].status == "failed"
    assert rows[over.request_id].error_category == "user"
    assert "max_storage_bytes" in (rows[over.request_id].error or "")
    assert rows[first.request_id].status == rows[after.request_id].status == "queued"
    assert len([key for key in who.objects() if key.endswith("/input.pb")]) == 2
    assert 16_000 < who.stored_bytes() <= 30_000


def test_storage_quota_refuses_what_does_not_fit_and_deleting_frees_it(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_storage_bytes=40_000)
    with who.rest() as http:
        model = _model(http)
        log = f"/v1/models/{model['id']}/log"
        small = http.post(log, json={"trajectory_groups": [support.group()]})
        assert small.status_code == 201, small.text
        held = who.stored_bytes()
        assert 0 < held < 5_000
        big = http.post(log, json={"trajectory_groups": [support.group()] * 40})
        assert big.status_code == 403, big.text
        error = big.json()["error"]
        assert error["type"] == "quota_exceeded"
        assert f"holds {held} of the 40000" in error["message"]
        assert "max_storage_bytes" in error["message"]
        assert "--max-storage-bytes" in error["message"]
        # Nothing of the refused batch stays: one batch listed, one object, same usage.
        assert len(http.get(f"/v1/models/{model['id']}/logs").json()["data"]) == 1
        assert len([key for key in who.objects() if "/logs/" in key]) == 1
        assert who.stored_bytes() == held

        # A training job's batch and a Tinker session's metadata count in the same quota.
        job = http.post(
            "/v1/training-jobs",
            json={"model_id": model["id"], "trajectory_groups": [support.group()] * 40},
        )
        assert job.status_code == 403 and "max_storage_bytes" in job.text

        async def metadata_over_quota() -> None:
            async with who.tinker(max_retries=0) as client:
                await _session(client, user_metadata={"k": "x" * 30_000})
                with pytest.raises(tinker.PermissionDeniedError, match="max_storage_bytes"):
                    await _session(client, user_metadata={"k": "x" * 30_000})

        asyncio.run(metadata_over_quota())
        assert who.count(TinkerSession) == 1

        # Deleting the model releases its batch's bytes.
        with_session = who.stored_bytes()
        assert http.delete(f"/v1/models/{model['id']}").status_code == 204
        assert who.stored_bytes() == with_session - held


def test_uploaded_files_count_in_the_storage_quota_and_deleting_one_frees_it(
    tenant: Callable[..., Who],
) -> None:
    """SFT data uploaded with POST /v1/files is held for the tenant like a batch: counted,
    refused past the quota with nothing stored, listed, and freed by deleting it."""
    who = tenant(max_storage_bytes=30_000)
    line = (json.dumps(support.sft_trajectory()) + "\n").encode()
    with who.rest() as http:
        small = http.post("/v1/files", files={"file": ("a.jsonl", line * 4)})
        assert small.status_code == 201, small.text
        uploaded = small.json()
        assert who.stored_bytes() == uploaded["bytes"] > 0
        big = http.post("/v1/files", files={"file": ("b.jsonl", line * 400)})
        assert big.status_code == 403, big.text
        assert big.json()["error"]["type"] == "quota_exceeded"
        assert "max_storage_bytes" in big.json()["error"]["message"]
        assert len([key for key in who.objects() if "/files/" in key]) == 1
        assert who.stored_bytes() == uploaded["bytes"]
        listed = http.get("/v1/files").json()["data"]
        assert [(f["id"], f["bytes"], f["uri"]) for f in listed] == [
            (uploaded["id"], uploaded["bytes"], uploaded["uri"])
        ]

        assert http.delete(f"/v1/files/{uploaded['id']}").status_code == 204
        assert who.stored_bytes() == 0
        assert [key for key in who.objects() if "/files/" in key] == []
        assert http.get("/v1/files").json()["data"] == []
        again = http.delete(f"/v1/files/{uploaded['id']}")
        assert again.status_code == 404 and uploaded["id"] in again.text
        # A file uploaded before files had rows (migration i38u): no row, but the tenant's.
        with who.plane.sessions() as session:
            tenant_id = tenants.get_tenant_by_name(session, name=who.name).id
        store = open_object_store(
            who.plane.settings.storage.resolved_object_store_url, who.plane.settings
        )
        legacy = uuid.uuid4().hex
        store.put_bytes(keys.file_key(tenant_id=tenant_id, file_id=legacy), line)
        assert http.delete(f"/v1/files/{legacy}").status_code == 204
        assert [key for key in who.objects() if "/files/" in key] == []
        assert http.delete(f"/v1/files/{legacy}").status_code == 404
        model = _model(http)
        job = http.post(
            "/v1/sft-training-jobs",
            json={"model_id": model["id"], "training_data_url": uploaded["uri"]},
        )
        assert job.status_code == 404, job.text


class _WriteWatchedStore(LocalObjectStore):
    """The control plane's own store (its directory), noting each write begun in it (a put or
    a writer opened): an observer of what reaches the store, not a fake."""

    def __init__(self, root: Path, writes: list[str]) -> None:
        super().__init__(root)
        self._writes = writes

    def put_bytes(self, key: str, data: bytes) -> None:
        self._writes.append(key)
        super().put_bytes(key, data)

    def put_stream(self, key: str, stream: BinaryIO) -> None:
        self._writes.append(key)
        super().put_stream(key, stream)

    def open_writer(self, key: str) -> ObjectWriter:
        self._writes.append(key)
        return super().open_writer(key)


def test_uploads_past_the_storage_quota_are_refused_before_they_reach_the_store(
    plane: Plane, tenant: Callable[..., Who]
) -> None:
    """At its quota, a tenant's file, batch and jobs are refused without a write to the store
    (a write then a delete each, before); near it, a file too big is refused as it is read."""
    who = tenant(max_storage_bytes=30_000)
    line = (json.dumps(support.sft_trajectory()) + "\n").encode()
    writes: list[str] = []
    with who.rest() as http:
        model = _model(http)
        assert http.post("/v1/files", files={"file": ("a.jsonl", line * 4)}).status_code == 201
        held = who.stored_bytes()
        real = plane.app.state.store
        plane.app.state.store = _WriteWatchedStore(real.root, writes)
        try:
            too_big = http.post("/v1/files", files={"file": ("b.jsonl", line * 400)})
            with plane.sessions() as session:
                values = {"max_storage_bytes": held}
                tenants.set_limits(session, tenant_name=who.name, values=values, reset=[])
            at_quota = [
                http.post("/v1/files", files={"file": ("c.jsonl", line)}),
                http.post(
                    f"/v1/models/{model['id']}/log", json={"trajectory_groups": [support.group()]}
                ),
                http.post(
                    "/v1/training-jobs",
                    json={"model_id": model["id"], "trajectory_groups": [support.group()]},
                ),
                http.post(
                    "/v1/sft-training-jobs",
                    json={"model_id": model["id"], "trajectories": [support.sft_trajectory()]},
                ),
            ]
        finally:
            plane.app.state.store = real
    assert too_big.status_code == 403, too_big.text
    assert too_big.json()["error"]["type"] == "quota_exceeded"
    assert "this file takes at least" in too_big.json()["error"]["message"]
    assert f"holds {held} of the 30000" in too_big.json()["error"]["message"]
    for refused in at_quota:
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "quota_exceeded"
        assert f"holds {held} of the {held} its storage quota allows" in error["message"]
        assert "(max_storage_bytes)" in error["message"]
    assert writes == []
    assert who.stored_bytes() == held
    assert len(who.objects()) == 1


def _skytrain(who: Who, *args: str) -> str:
    """`skytrain ARGS` as the operator runs it on the control plane's database."""
    env = {
        "SKYTRAIN_HOME": str(who.plane.settings.storage.home),
        "SKYTRAIN_DATABASE_URL": who.plane.settings.storage.resolved_database_url,
    }
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli_app, list(args), env=env)
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_operator_sets_the_storage_quotas_with_the_cli(tenant: Callable[..., Who]) -> None:
    who = tenant()
    shown = _skytrain(
        who,
        "tenants",
        "limits",
        who.name,
        *("--max-storage-bytes", "9000", "--max-metadata-bytes", "100"),
        *("--max-queued-operations", "7"),
    )
    rows = {line.split()[0]: line.split()[1:] for line in shown.splitlines()}
    assert rows["max_storage_bytes"] == ["9000", "this", "tenant"]
    assert rows["max_metadata_bytes"] == ["100", "this", "tenant"]
    assert rows["max_queued_operations"] == ["7", "this", "tenant"]

    async def refused() -> None:
        async with who.tinker(max_retries=0) as client:
            with pytest.raises(tinker.APIStatusError, match=r"max_metadata_bytes \(100\)"):
                await _session(client, user_metadata={"k": "x" * 100})

    asyncio.run(refused())


def test_usage_is_shown_to_the_tenant_and_to_the_operator(tenant: Callable[..., Who]) -> None:
    who = tenant(max_storage_bytes=50_000)
    with who.rest() as http:
        model = _model(http)
        logged = http.post(
            f"/v1/models/{model['id']}/log", json={"trajectory_groups": [support.group()]}
        )
        assert logged.status_code == 201
        usage = http.get("/v1/usage").json()
    stored = who.stored_bytes()
    assert stored > 0
    assert usage["tenant"] == who.name
    quotas = {q["name"]: (q["used"], q["limit"]) for q in usage["quotas"]}
    assert quotas["max_models"] == (1, 100)
    assert quotas["max_storage_bytes"] == (stored, 50_000)
    assert quotas["max_metadata_bytes"] == (0, 65_536)
    assert quotas["max_sessions"] == (0, 256)
    assert quotas["max_queued_jobs"] == (0, 256)
    rows = {
        line.split()[0]: line.split()[1:]
        for line in _skytrain(who, "tenants", "show", who.name).splitlines()
    }
    assert rows["max_models"] == ["1", "100", "default"]
    assert rows["max_storage_bytes"] == [str(stored), "50000", "this", "tenant"]
    assert rows["max_queued_operations"] == ["-", "256", "default"]
