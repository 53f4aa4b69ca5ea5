"""What the gateway answers when it cannot serve: unknown or foreign models and steps (404),
no engine for the checkpoint yet (503 with Retry-After and what is happening), malformed
requests (400), engines that cannot be reached or refuse the control plane; and the activity
marks the scheduler reads."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy
from sqlalchemy import event

from skytrain_backend.db import api_keys, credentials
from skytrain_backend.db.models import Checkpoint, Model, Worker, utcnow
from skytrain_backend.errors import Unavailable
from skytrain_backend.scheduler import placement
from skytrain_backend.scheduler.routing import ACTIVITY_RESOLUTION_S, resolve_route
from tests.fixtures.ports import free_port
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import (
    ENGINE_SERVED_NAME,
    LOADING_WAIT_S,
    Engine,
    OnEngine,
    Tenant,
    add_checkpoint,
    add_engine_worker,
    add_worker,
    load_adapter,
    mark_served,
    wait_until,
)


def _error(response: object) -> tuple[int, str, str]:
    status = response.status_code  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    return status, error["type"], error["message"]


def test_unknown_and_foreign_models_are_not_found(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice, mallory = tenant(), tenant()
    model = alice.create_model(worker_id=engine_worker)
    name = model["inference_name"]

    for reference in (name, f"{name}:step0", f"wandb-artifact:///{name}", model["id"]):
        status, type_, message = _error(mallory.chat(reference))
        assert (status, type_) == (404, "not_found_error")
        assert repr(reference) in message and "GET /v1/models" in message
    status, _, message = _error(alice.chat(f"{alice.name}/gw/never-created"))
    assert status == 404 and "never-created" in message
    with pytest.raises(openai.NotFoundError):
        mallory.openai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}]
        )
    assert alice.chat(name).status_code == 200  # the owner is served


def test_missing_step_is_not_found_naming_the_latest_step(
    on_engine: OnEngine,
    gateway_plane: ServedPlane,
) -> None:
    alice, model = on_engine
    add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=1)

    status, _, message = _error(alice.chat(f"{model['inference_name']}:step7"))

    assert status == 404
    assert "no step 7" in message and "latest step is 1" in message


def test_deleted_step_is_not_found_saying_it_was_deleted(
    on_engine: OnEngine,
    gateway_plane: ServedPlane,
) -> None:
    alice, model = on_engine
    for step in (1, 2):
        add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=step)
    response = alice.http.request(
        "DELETE", f"/v1/models/{model['id']}/checkpoints", json={"steps": [1]}
    )
    assert response.status_code == 200, response.text

    status, _, message = _error(alice.chat(f"{model['inference_name']}:step1"))

    assert status == 404
    assert "step 1" in message and "was deleted" in message and "latest step is 2" in message


def test_model_without_worker_is_unavailable_with_retry_after(
    tenant: Callable[[], Tenant],
) -> None:
    alice = tenant()
    name = alice.create_model(base_model="tests/nobody-serves-this")["inference_name"]

    response = alice.chat(name)

    status, type_, message = _error(response)
    assert (status, type_) == (503, "unavailable_error")
    assert "waiting for a worker for tests/nobody-serves-this" in message
    assert int(response.headers["retry-after"]) >= 1
    with pytest.raises(openai.InternalServerError) as caught:
        alice.openai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 503


def test_model_on_a_starting_worker_is_unavailable_saying_so(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane
) -> None:
    alice = tenant()
    worker = add_worker(gateway_plane.sessions, base_model="tests/starting-base", status="starting")
    name = alice.create_model(base_model="tests/starting-base", worker_id=worker)["inference_name"]

    response = alice.chat(name)

    status, _, message = _error(response)
    assert status == 503
    assert f"worker {worker} is starting its engine" in message
    assert int(response.headers["retry-after"]) >= 1


@pytest.mark.slow
def test_step_not_loaded_yet_is_unavailable_saying_it_is_loading(
    on_engine: OnEngine,
    gateway_plane: ServedPlane,
) -> None:
    alice, model = on_engine
    add_checkpoint(
        gateway_plane.sessions, model_id=model["id"], step=1
    )  # committed, not in `served`

    for reference in (model["inference_name"], f"{model['inference_name']}:step1"):
        response = alice.chat(reference)
        status, _, message = _error(response)
        assert status == 503
        assert f"loading step 1 of {model['inference_name']}" in message
        assert response.headers["retry-after"] == "1"
    assert alice.chat(f"{model['inference_name']}:step0").status_code == 200


def test_a_request_waits_for_its_checkpoint_to_finish_loading(
    on_engine: OnEngine,
    engine_worker: str,
    engine: Engine,
    gateway_plane: ServedPlane,
    step1_adapter: Path,
) -> None:
    alice, model = on_engine
    load_adapter(engine, model_id=model["id"], step=1, path=step1_adapter)
    add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=1)
    # The worker's heartbeat reports the step served a moment after the request arrives.
    loaded = threading.Timer(
        LOADING_WAIT_S / 3,
        mark_served,
        args=(gateway_plane.sessions,),
        kwargs={"worker_id": engine_worker, "model_id": model["id"], "step": 1},
    )
    loaded.start()
    try:
        response = alice.chat(f"{model['inference_name']}:step1")
    finally:
        loaded.join()
    assert response.headers.get("x-skytrain-step") == "1"


def test_a_committed_step_is_served_at_once_and_a_deleted_model_not_at_all(
    on_engine: OnEngine,
    engine_worker: str,
    engine: Engine,
    gateway_plane: ServedPlane,
    step1_adapter: Path,
) -> None:
    """The route cache (kept far longer than this test) is emptied by the commits that
    change a route: the latest step, and the model itself."""
    alice, model = on_engine
    name = model["inference_name"]
    assert alice.chat(name).headers.get("x-skytrain-step") == "0"
    load_adapter(engine, model_id=model["id"], step=1, path=step1_adapter)
    mark_served(gateway_plane.sessions, worker_id=engine_worker, model_id=model["id"], step=1)
    assert alice.chat(name).headers.get("x-skytrain-step") == "0"  # not committed yet

    add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=1)
    assert alice.chat(name).headers.get("x-skytrain-step") == "1"

    assert alice.http.delete(f"/v1/models/{model['id']}").status_code == 204
    status, _, message = _error(alice.chat(name))
    assert status == 404
    assert "not found" in message


def test_a_revoked_key_and_a_gone_worker_are_seen_at_once(
    tenant: Callable[[], Tenant], engine: Engine, gateway_plane: ServedPlane
) -> None:
    """The other commits that change a cached route (kept far longer than this test) empty
    the cache too: a key revoked, a worker lost."""
    alice, bob = tenant(), tenant()
    worker_id = add_engine_worker(gateway_plane.sessions, engine, base_model="tests/lost-worker")
    alices = alice.create_model(worker_id=worker_id, base_model="tests/lost-worker")
    bobs = bob.create_model(worker_id=worker_id, base_model="tests/lost-worker")
    assert alice.chat(alices["inference_name"]).status_code == 200
    served = bob.chat(bobs["inference_name"])
    assert served.headers.get("x-skytrain-worker") == worker_id

    with gateway_plane.sessions() as session:
        api_keys.revoke_key(session, id_or_prefix=alice.key[: api_keys.DISPLAY_PREFIX_LENGTH])
    status, _, message = _error(alice.chat(alices["inference_name"]))
    assert status == 401 and "was revoked" in message

    with gateway_plane.sessions() as session:
        worker = session.get_one(Worker, worker_id)
        placement.worker_gone(session, worker=worker, status="lost", reason="no heartbeat")
    status, _, message = _error(bob.chat(bobs["inference_name"]))
    assert status == 503 and "waiting for a worker for tests/lost-worker" in message


def test_a_repeated_request_reads_none_of_its_route_again(on_engine: OnEngine) -> None:
    """The route cache (kept ``ROUTE_CACHE_TTL_S``, far longer than this test) holds what a
    key and a model name resolved to: the key, the model, its step and its worker are read
    for the first request only. Nothing else committed meanwhile empties it: the scheduler,
    placing the model as the test does, keeps the placement it finds
    (``scheduler/placement.py``)."""
    alice, model = on_engine
    # Statements made to resolve alice's requests, which bind her key's hash or her name (the
    # model's entity); the scheduler's passes run meanwhile.
    hers = (credentials.hash_secret(alice.key), alice.name)
    statements: list[str] = []

    def note(
        _conn: object, _cursor: object, statement: str, parameters: object, *_: object
    ) -> None:
        if any(value in str(parameters) for value in hers):
            statements.append(statement)

    def route_reads() -> list[str]:
        tables = re.compile(r"\b(api_keys|models|checkpoints|workers)\b")
        return [statement for statement in statements if tables.search(statement)]

    event.listen(sqlalchemy.Engine, "before_cursor_execute", note)
    try:
        assert alice.chat(model["inference_name"]).status_code == 200
        first = route_reads()
        statements.clear()
        assert alice.chat(model["inference_name"]).status_code == 200
    finally:
        event.remove(sqlalchemy.Engine, "before_cursor_execute", note)
    assert any("FROM api_keys" in statement for statement in first)
    assert any("FROM models" in statement for statement in first)
    assert route_reads() == []


def test_unreachable_engine_is_unavailable(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane
) -> None:
    alice = tenant()
    dead = f"http://127.0.0.1:{free_port()}"
    worker = add_worker(
        gateway_plane.sessions,
        base_model="tests/dead-engine",
        engine_endpoint=dead,
        served_model_name=ENGINE_SERVED_NAME,
    )
    name = alice.create_model(base_model="tests/dead-engine", worker_id=worker)["inference_name"]

    response = alice.chat(name)

    status, _, message = _error(response)
    assert status == 503
    assert f"engine of worker {worker} cannot be reached" in message
    # The worker's address is the operator's business: it goes to the log, not to tenants.
    assert dead.removeprefix("http://") not in message and "127.0.0.1" not in message
    assert "retry-after" in response.headers


def test_engine_refusing_the_control_planes_secret_is_a_bad_gateway(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane, engine: Engine
) -> None:
    alice = tenant()
    worker = add_worker(
        gateway_plane.sessions,
        base_model="tests/stale-secret",
        engine_endpoint=engine.url,
        engine_secret="not-the-engines-secret",
        served_model_name=engine.served_name,
    )
    name = alice.create_model(base_model="tests/stale-secret", worker_id=worker)["inference_name"]

    status, type_, message = _error(alice.chat(name))

    assert (status, type_) == (502, "engine_error")
    assert "refused the control plane's credentials" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": []}', "model is required"),
        (b'{"model": "just-a-name", "messages": []}', "is not a skytrain model name"),
        (b'{"model": "a/b/c", "stream": "yes", "messages": []}', "stream must be true or false"),
    ],
)
def test_malformed_requests_are_refused_naming_the_problem(
    tenant: Callable[[], Tenant], body: bytes, expected: str
) -> None:
    alice = tenant()

    response = alice.http.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )

    status, type_, message = _error(response)
    assert (status, type_) == (400, "invalid_request_error")
    assert expected in message


def test_requests_need_an_api_key(gateway_plane: ServedPlane) -> None:
    client = openai.OpenAI(base_url=f"{gateway_plane.url}/v1", api_key="sk-st-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="a/b/c", messages=[{"role": "user", "content": "x"}])


def test_requests_mark_the_model_and_a_pinned_step_active_at_most_every_30s(
    on_engine: OnEngine,
    gateway_plane: ServedPlane,
) -> None:
    alice, model = on_engine
    # Older than the marks' resolution, so the next request writes one; far younger than the
    # idle timeout (300 s), so the scheduler running meanwhile does not take the model off as
    # idle and place it again (which writes the mark too).
    long_ago = utcnow() - timedelta(seconds=2 * ACTIVITY_RESOLUTION_S)
    with gateway_plane.sessions() as session:
        row = session.get(Model, model["id"])
        assert row is not None
        row.last_active_at = long_ago
        session.commit()

    def marks() -> tuple[object, object]:
        with gateway_plane.sessions() as session:
            row = session.get(Model, model["id"])
            step0 = session.query(Checkpoint).filter_by(model_id=model["id"], step=0).one()
            assert row is not None
            return row.last_active_at, step0.last_requested_at

    before = utcnow()
    assert alice.chat(model["inference_name"]).status_code == 200
    model_mark, step_mark = marks()
    assert model_mark is not None and model_mark >= before  # type: ignore[operator]
    assert step_mark is None  # not pinned: no checkpoint mark

    assert alice.chat(f"{model['inference_name']}:step0").status_code == 200
    model_mark_again, step_mark = marks()
    assert step_mark is not None and step_mark >= before  # type: ignore[operator]
    assert model_mark_again == model_mark  # within 30 s: not written again
    assert alice.chat(f"{model['inference_name']}:step0").status_code == 200
    assert marks() == (model_mark, step_mark)


def test_request_to_a_worker_marks_it_active(
    tenant: Callable[[], Tenant], engine: Engine, gateway_plane: ServedPlane
) -> None:
    alice = tenant()
    model = alice.create_model(base_model="tests/marked-worker")
    worker_id = add_engine_worker(gateway_plane.sessions, engine, base_model="tests/marked-worker")

    def placed() -> bool:
        with gateway_plane.sessions() as session:
            row = session.get(Model, model["id"])
            return row is not None and row.worker_id == worker_id

    # The scheduler places the model on the new worker (marking the worker as it does); from
    # then on only requests mark it.
    wait_until(placed, what="the scheduler placing the model on the worker")
    with gateway_plane.sessions() as session:
        worker = session.get(Worker, worker_id)
        assert worker is not None
        worker.last_active_at = utcnow() - timedelta(hours=1)
        session.commit()
    before = utcnow()

    assert alice.chat(model["inference_name"]).status_code == 200

    with gateway_plane.sessions() as session:
        worker = session.get(Worker, worker_id)
        assert worker is not None and worker.last_active_at is not None
        assert worker.last_active_at >= before


def test_checkpoint_missing_from_the_engine_is_unavailable_not_unknown(
    on_engine: OnEngine,
    engine_worker: str,
    gateway_plane: ServedPlane,
) -> None:
    alice, model = on_engine
    # The worker reported step 1 as served, but its engine does not have the adapter (an
    # engine restarted, say): the caller should retry, not conclude the model is gone.
    add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=1)
    mark_served(gateway_plane.sessions, worker_id=engine_worker, model_id=model["id"], step=1)

    response = alice.chat(f"{model['inference_name']}:step1")

    status, _, message = _error(response)
    assert status == 503
    assert "does not serve step 1 of this model right now" in message
    assert "retry-after" in response.headers


def test_sleeping_engine_is_unavailable(
    tenant: Callable[[], Tenant], engine_worker: str, engine: Engine
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    assert httpx.post(engine.url + "/sleep", headers=engine.headers, timeout=60).status_code == 200
    try:
        response = alice.chat(name)
    finally:
        woken = httpx.post(engine.url + "/wake_up", headers=engine.headers, timeout=60)
        assert woken.status_code == 200

    status, _, message = _error(response)
    assert status == 503
    assert f"the engine of worker {engine_worker} cannot serve now" in message
    assert alice.chat(name).status_code == 200


@pytest.mark.parametrize(("idle_timeout_s", "refreshed"), [(8.0, True), (1800.0, False)])
def test_unplaced_model_is_marked_within_the_idle_timeout_and_the_scheduler_woken(
    tenant: Callable[[], Tenant],
    gateway_plane: ServedPlane,
    idle_timeout_s: float,
    refreshed: bool,
) -> None:
    alice = tenant()
    model = alice.create_model(base_model="tests/nobody-serves-this-either")
    five_seconds_ago = utcnow() - timedelta(seconds=5)
    with gateway_plane.sessions() as session:
        row = session.get(Model, model["id"])
        assert row is not None
        row.last_active_at = five_seconds_ago
        session.commit()
        tenant_id = row.tenant_id
    woken: list[bool] = []

    with gateway_plane.sessions() as session, pytest.raises(Unavailable):
        resolve_route(
            session,
            tenant_id=tenant_id,
            model=model["inference_name"],
            idle_timeout_s=idle_timeout_s,
            on_unplaced=lambda: woken.append(True),
        )

    assert woken == [True]
    with gateway_plane.sessions() as session:
        row = session.get(Model, model["id"])
        assert row is not None and row.last_active_at is not None
        # A mark older than a quarter of the idle timeout is refreshed (the scheduler would
        # soon see the model as idle); a fresh one within 30 s is left alone.
        assert (row.last_active_at > five_seconds_ago) is refreshed


def test_a_slot_held_beyond_a_fair_share_goes_to_the_waiting_tenant(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane
) -> None:
    """A tenant whose models fill a worker no longer keeps every slot by using them: the
    control plane's scheduler gives another tenant's new model the slot of its least recently
    used one, whose requests then get 503 saying why and when to retry (not that a worker
    starts: this control plane starts none)."""
    alice, bob = tenant(), tenant()
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    worker = add_worker(gateway_plane.sessions, base_model=base)
    with gateway_plane.sessions() as session:
        session.get_one(Worker, worker).capacity = {"max_models": 2}
        session.commit()
    alices = [alice.create_model(base_model=base, worker_id=worker) for _ in range(2)]
    bobs = bob.create_model(base_model=base)["id"]

    def placed(model_id: str) -> str | None:
        with gateway_plane.sessions() as session:
            return session.get_one(Model, model_id).worker_id

    wait_until(lambda: placed(bobs) == worker, what="bob's model placed by fair share")
    assert (placed(alices[0]["id"]), placed(alices[1]["id"])) == (None, worker)

    response = alice.chat(alices[0]["inference_name"])
    status, _, message = _error(response)
    assert status == 503
    assert "no tenant holds more than its fair share" in message and "1 of 2" in message
    assert "starts" not in message
    assert int(response.headers["retry-after"]) == 30
    assert placed(bobs) == worker  # nothing moves back
