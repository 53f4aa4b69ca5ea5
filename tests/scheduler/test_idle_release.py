"""Placement slots turn over: a model idle for ``SKYTRAIN_MODEL_IDLE_TIMEOUT_S`` is taken off its
worker (the worker's heartbeat answer no longer lists it, so the agent unloads its adapters),
the model that waited for its place gets it, and the idle model's next request places it again.

A real control plane (uvicorn in this process, SQLite, its scheduler running) with a short idle
timeout; the worker is a row and an HTTP client calling the worker routes as the agent does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

import tinker
from skytrain_backend.db import api_keys
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, TrainingJob, utcnow
from tests.fixtures.services import MakeSettings, ServedPlane, served_plane
from tests.gateway.conftest import wait_until
from tinker import types

# Long enough that the models a test keeps using (a request each round) never go idle.
IDLE_S = 5.0
SLOTS = 8  # the default of both a worker's max_models and a tenant's max_placed_models


@pytest.fixture(scope="module")
def plane(make_settings: MakeSettings) -> Iterator[ServedPlane]:
    with served_plane(make_settings(scheduler={"model_idle_timeout_s": IDLE_S})) as plane:
        yield plane


@dataclass(frozen=True)
class Site:
    """A tenant of its own (``key``) and a ready worker of its own base model, whose agent
    (``agent``, an HTTP client with the worker's token) calls the worker routes."""

    base_model: str
    key: str
    worker_id: str
    agent: httpx.Client

    def placed_here(self) -> set[str]:
        """The models the control plane's heartbeat answer places on the worker."""
        answer = self.agent.post("/heartbeat", json={"status": "ready"})
        assert answer.status_code == 200, answer.text
        return {item["model_id"] for item in answer.json()["models"]}


@pytest.fixture(scope="module")
def patient_plane(make_settings: MakeSettings) -> Iterator[ServedPlane]:
    """A control plane whose models go idle only when a test says so (``_gone_idle``): its
    idle timeout is longer than any test, however slow the machine."""
    with served_plane(make_settings(scheduler={"model_idle_timeout_s": 3600})) as plane:
        yield plane


def _gone_idle(plane: ServedPlane, *model_ids: str) -> None:
    """The models were last used two idle timeouts ago (as if time had passed)."""
    long_ago = utcnow() - timedelta(seconds=2 * plane.settings.scheduler.model_idle_timeout_s)
    with plane.sessions() as session:
        session.execute(
            update(Model).where(Model.id.in_(model_ids)).values(last_active_at=long_ago)
        )
        session.commit()


@pytest.fixture
def site(plane: ServedPlane) -> Iterator[Site]:
    with _site(plane) as made:
        yield made


@pytest.fixture
def patient_site(patient_plane: ServedPlane) -> Iterator[Site]:
    with _site(patient_plane) as made:
        yield made


@contextmanager
def _site(plane: ServedPlane) -> Iterator[Site]:
    base_model = f"tests/base-{uuid.uuid4().hex[:8]}"
    with plane.sessions() as session:
        _, key = api_keys.create_key(session, tenant_name=f"t-{uuid.uuid4().hex[:8]}")
        worker, token = worker_rows.create_worker(
            session, provider="manual", base_model=base_model, max_models=SLOTS, status="ready"
        )
        session.commit()
        worker_id = worker.id
    with httpx.Client(
        base_url=f"{plane.url}/v1/worker", headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as agent:
        yield Site(base_model=base_model, key=key, worker_id=worker_id, agent=agent)


@pytest.mark.slow
def test_a_ninth_model_gets_the_place_of_one_that_went_idle(
    patient_plane: ServedPlane, patient_site: Site
) -> None:
    plane, site = patient_plane, patient_site
    user = httpx.Client(
        base_url=plane.url, headers={"Authorization": f"Bearer {site.key}"}, timeout=60
    )

    def register(name: str) -> dict[str, Any]:
        """Create the model, or use it again (registering marks a model active)."""
        response = user.post(
            "/v1/models",
            json={
                "project": "idle",
                "name": name,
                "base_model": site.base_model,
                "return_existing": True,
            },
        )
        assert response.status_code in (200, 201), response.text
        return dict(response.json())

    def serving(model: dict[str, Any]) -> dict[str, Any]:
        return dict(user.get(f"/v1/models/{model['id']}").json()["serving"])

    with user:
        models = [register(f"m{index}") for index in range(SLOTS)]
        wait_until(
            lambda: site.placed_here() == {m["id"] for m in models},
            what="the eight models placed on the worker",
            timeout_s=30,
        )
        ninth = register("m8")
        shown = serving(ninth)
        assert shown["state"] == "waiting" and not shown["ready"]
        assert f"max_placed_models={SLOTS}" in shown["message"]
        assert "idle" in shown["message"]

        first, busy = models[0], models[1:]
        _gone_idle(plane, first["id"])

        def ninth_placed_while_the_others_are_used() -> bool:
            # The ninth is asked for too, as a client waiting for it would.
            for model in [*busy, ninth]:
                register(model["name"])
            return ninth["id"] in site.placed_here()

        wait_until(
            ninth_placed_while_the_others_are_used,
            what="the ninth model placed in the idle one's slot",
            timeout_s=30,
        )
        # The idle model left the worker (whose agent unloads its adapters); the used ones
        # kept their places.
        here = site.placed_here()
        assert first["id"] not in here
        assert here == {m["id"] for m in busy} | {ninth["id"]}

        # Everything goes idle; the first model's next use places it again.
        _gone_idle(plane, *(m["id"] for m in busy), ninth["id"])
        wait_until(lambda: not site.placed_here(), what="all models released", timeout_s=30)
        register(first["name"])
        wait_until(
            lambda: site.placed_here() == {first["id"]},
            what="the idle model placed again on its next use",
            timeout_s=30,
        )


@pytest.mark.slow
def test_a_tinker_run_keeps_its_place_while_an_operation_waits_and_leaves_after(
    plane: ServedPlane, site: Site
) -> None:
    """A Tinker run with an operation waiting for its worker (here its creation, which no
    agent runs) holds its model's place however long that takes; once its session ends, its
    model leaves like any idle one."""
    service = tinker.ServiceClient(base_url=plane.url, api_key="tml-" + site.key)

    # The run's creation waits for a worker agent to build its trainer (this one never
    # does): its future is left pending; its model is placed at once.
    service.create_lora_training_client(base_model=site.base_model, rank=8)
    wait_until(lambda: len(site.placed_here()) == 1, what="the run's model placed", timeout_s=30)
    (run_model,) = site.placed_here()
    time.sleep(IDLE_S * 2)  # idle: nothing sampled or trained, yet the run is open
    assert site.placed_here() == {run_model}
    service.close("success").result(timeout=60)
    wait_until(lambda: not site.placed_here(), what="the ended run's model released", timeout_s=30)


@pytest.mark.slow
def test_an_idle_tinker_run_gives_its_place_back_and_its_next_operation_resumes_it(
    plane: ServedPlane, site: Site
) -> None:
    """The gap: placement counted any open job as activity, and a Tinker run's job runs for as
    long as its session heartbeats, so a run with nothing to do held its slot for ever. Now a
    run with no operation queued or running for the idle timeout gives its place back: its
    job is queued again (a preemption, not a failed attempt) and its worker loses the lease;
    its next operation places it again, and the worker that leases it rebuilds it from its
    creation."""
    service = tinker.ServiceClient(base_url=plane.url, api_key="tml-" + site.key)

    def lease() -> dict[str, Any]:
        leased = site.agent.post("/tinker/lease")
        assert leased.status_code == 200, leased.text
        return dict(leased.json()["run"])

    def next_operation(run: dict[str, Any], seq_id: int) -> httpx.Response:
        return site.agent.post(
            f"/tinker/runs/{run['job_id']}/next",
            json={"attempt": run["attempt"], "seq_id": seq_id, "wait_s": 0},
        )

    created = service.create_lora_training_client(base_model=site.base_model, rank=8)
    wait_until(lambda: len(site.placed_here()) == 1, what="the run's model placed", timeout_s=30)
    (run_model,) = site.placed_here()
    # The agent builds the run (operation 0, its creation) as a worker does; then the run
    # has nothing to do.
    first = lease()
    assert next_operation(first, 0).status_code == 200
    done = site.agent.post(
        f"/tinker/runs/{first['job_id']}/operations/0/complete",
        json={"attempt": first["attempt"], "result": {}, "has_output": False},
    )
    assert done.status_code == 204, done.text
    training = created.result(timeout=60)

    wait_until(lambda: not site.placed_here(), what="the idle run's model released", timeout_s=30)
    assert next_operation(first, 1).status_code == 409  # its worker lets the trainer go
    with plane.sessions() as session:
        job = session.get_one(TrainingJob, first["job_id"])
        assert (job.status, job.worker_id, job.attempts, job.preemptions) == (
            "queued",
            None,
            1,
            1,
        )

    # Its next operation places it again; the worker rebuilds it from its creation.
    training.optim_step(types.AdamParams(learning_rate=1e-4))
    wait_until(lambda: site.placed_here() == {run_model}, what="the run placed again", timeout_s=30)
    second = lease()
    assert (second["job_id"], second["attempt"]) == (first["job_id"], 2)
    assert second["plan"]["restore"]["seed"] is not None
    assert (second["plan"]["replay"], second["plan"]["next_seq"]) == ([], 1)
    answer = next_operation(second, 1)
    assert answer.status_code == 200, answer.text
    assert answer.json()["operation"]["kind"] == "optim_step"
    service.close("success").result(timeout=60)


@pytest.mark.slow
def test_a_model_taken_off_its_worker_for_idleness_says_it_is_idle(
    plane: ServedPlane, site: Site
) -> None:
    """GET /v1/models/{id} of a model released for idleness says it is idle and loads on its
    next request, not that it is loading; its next use places it again."""
    user = httpx.Client(
        base_url=plane.url, headers={"Authorization": f"Bearer {site.key}"}, timeout=60
    )
    body = {
        "project": "idle",
        "name": "quiet",
        "base_model": site.base_model,
        "return_existing": True,
    }

    with user:
        created = user.post("/v1/models", json=body)
        assert created.status_code == 201, created.text
        model_id = created.json()["id"]
        wait_until(lambda: site.placed_here() == {model_id}, what="the model placed", timeout_s=30)
        wait_until(lambda: not site.placed_here(), what="the idle model released", timeout_s=30)

        shown = user.get(f"/v1/models/{model_id}")
        assert shown.status_code == 200, shown.text
        serving = shown.json()["serving"]
        assert serving["state"] == "idle" and not serving["ready"], serving
        assert "idle: loads on its next request" in serving["message"]
        assert "loading" not in serving["message"] and "few seconds" not in serving["message"]

        # Its next use makes it active: no longer idle, it is placed again.
        again = user.post("/v1/models", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["serving"]["state"] != "idle"
        wait_until(lambda: site.placed_here() == {model_id}, what="placed again", timeout_s=30)
        assert user.get(f"/v1/models/{model_id}").json()["serving"]["worker_id"] == site.worker_id
