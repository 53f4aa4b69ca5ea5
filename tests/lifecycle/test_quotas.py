"""Quotas per tenant, set by the operator with `skytrain tenants limits`: models owned (403 on
create), models placed and workers occupied at once (the next model waits; its requests get
429 with Retry-After), so one tenant's models cannot fill every worker."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Model
from skytrain_backend.scheduler.loop import Scheduler
from tests.fixtures.cli import run_cli
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import wait_until
from tests.lifecycle.conftest import Who, WorkerClient, new_base_model


def test_a_tenant_over_its_model_quota_gets_403_and_the_operator_can_change_it(
    who: Callable[..., Who], lifecycle_settings: Settings
) -> None:
    alice, bob = who(), who()
    set_by_cli = run_cli(lifecycle_settings, "tenants", "limits", alice.name, "--max-models", "2")
    assert set_by_cli.exit_code == 0, set_by_cli.stderr
    assert "max_models" in set_by_cli.stdout and "this tenant" in set_by_cli.stdout

    first, second = alice.create_model(), alice.create_model()
    refused = alice.post_model()
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["type"] == "quota_exceeded"
    assert "your tenant owns 2 models, the most its quota allows (2)" in error["message"]
    assert "Retry-After" not in refused.headers  # waiting does not help here
    names = [m["id"] for m in alice.http.get("/v1/models").json()["data"]]
    assert sorted(names) == sorted([first["id"], second["id"]])  # nothing half-stored
    existing = alice.http.post(
        "/v1/models",
        json={
            "project": first["project"],
            "name": first["name"],
            "base_model": first["base_model"],
            "return_existing": True,
        },
    )
    assert existing.status_code == 200  # getting an existing model is not creating one
    assert bob.post_model().status_code == 201  # other tenants keep the default

    listed = run_cli(lifecycle_settings, "tenants", "list")
    assert listed.exit_code == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(alice.name)]
    assert "2*" in row.split()
    reset = run_cli(lifecycle_settings, "tenants", "limits", alice.name, "--reset", "max_models")
    assert reset.exit_code == 0, reset.stderr
    assert alice.post_model().status_code == 201

    unknown = run_cli(lifecycle_settings, "tenants", "limits", "nobody", "--max-models", "1")
    assert unknown.exit_code == 1
    assert "no tenant 'nobody'" in unknown.stderr


def test_one_tenants_fourteen_models_do_not_fill_every_worker(
    who: Callable[..., Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_plane: ServedPlane,
    lifecycle_settings: Settings,
) -> None:
    base = new_base_model()
    busy, quiet = who(base), who(base)
    # Two workers with room for seven models each: fourteen slots in all.
    for _ in range(2):
        worker_client(base_model=base, max_models=7)
    busy_models = [busy.create_model() for _ in range(14)]
    quiet_model = quiet.create_model()

    def placed(model_ids: list[str]) -> list[str | None]:
        with lifecycle_plane.sessions() as session:
            return [
                session.scalar(select(Model.worker_id).where(Model.id == model_id))
                for model_id in model_ids
            ]

    wait_until(
        lambda: placed([quiet_model["id"]]) != [None],
        what="the quiet tenant's model being placed",
        timeout_s=30,
    )
    limit = lifecycle_settings.tenant_limits.max_placed_models
    busy_placed = placed([m["id"] for m in busy_models])
    assert sum(worker is not None for worker in busy_placed) == limit

    waiting = next(m for m, w in zip(busy_models, busy_placed, strict=True) if w is None)
    shown = busy.http.get(f"/v1/models/{waiting['id']}").json()["serving"]
    assert shown["state"] == "waiting" and not shown["ready"]
    assert f"max_placed_models={limit}" in shown["message"]
    request = busy.http.post(
        "/v1/chat/completions",
        json={"model": waiting["inference_name"], "messages": [{"role": "user", "content": "x"}]},
    )
    assert request.status_code == 429
    assert request.json()["error"]["type"] == "rate_limit_error"
    assert "the most its quota allows" in request.json()["error"]["message"]
    assert int(request.headers["Retry-After"]) >= 1


def test_a_tenant_at_its_worker_quota_waits_rather_than_spreading(
    who: Callable[..., Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_plane: ServedPlane,
    lifecycle_settings: Settings,
) -> None:
    base = new_base_model()
    alice = who(base)
    assert (
        run_cli(lifecycle_settings, "tenants", "limits", alice.name, "--max-workers", "1").exit_code
        == 0
    )
    first_worker = worker_client(base_model=base, max_models=1)
    worker_client(base_model=base, max_models=1)
    first, second = alice.create_model(), alice.create_model()

    def worker_of(model_id: str) -> str | None:
        with lifecycle_plane.sessions() as session:
            return session.scalar(select(Model.worker_id).where(Model.id == model_id))

    # A scheduling pass of our own, after both models exist (the control plane runs them too).
    Scheduler(settings=lifecycle_settings, sessions=lifecycle_plane.sessions, provider=None).tick()
    assert worker_of(first["id"]) == first_worker.worker_id  # the first worker, now full
    assert worker_of(second["id"]) is None  # the second worker has room, but not for alice
    shown = alice.http.get(f"/v1/models/{second['id']}").json()["serving"]
    assert "max_workers=1" in shown["message"]
