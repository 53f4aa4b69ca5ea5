"""A heartbeat retried after the control plane was away says what the worker does at that try.

The worker's client retries a heartbeat while the control plane cannot be reached (up to
``retry_for_s``). It used to send the body built before the first try: a worker whose engine
slept at that moment, then woke and committed a job, set itself back to ``sleeping`` (and its
served list to the one without the new step) once the control plane answered again. The
first try here fails at the connection, the one fault injected; the control plane is real.
"""

from __future__ import annotations

import httpx

from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Worker
from skytrain_backend.protocol import Heartbeat
from skytrain_backend.worker.client import ControlPlaneClient
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import new_base_model


async def test_a_retried_heartbeat_sends_the_workers_state_at_that_try(
    lifecycle_plane: ServedPlane,
) -> None:
    with lifecycle_plane.sessions() as session:
        worker, token = worker_rows.create_worker(
            session, provider="manual", base_model=new_base_model(), max_models=8, status="ready"
        )
        session.commit()
        worker_id = worker.id
    client = ControlPlaneClient(lifecycle_plane.url, token, retry_for_s=60)
    tries: list[str] = []

    async def away_at_first(request: httpx.Request) -> None:
        if request.url.path.endswith("/heartbeat") and not tries:
            tries.append("refused")
            raise httpx.ConnectError("the control plane is away", request=request)
        tries.append("sent")

    # The fault: the first try's connection fails (the client's own HTTP client, as a
    # restarting control plane would make it fail).
    client._http.event_hooks["request"].append(away_at_first)
    # Asleep when the first try was built; awake (a job committed) by the second.
    states = iter(["sleeping", "training"])
    try:
        await client.heartbeat(lambda: Heartbeat(status=next(states)))
    finally:
        await client.aclose()
    assert tries == ["refused", "sent"]
    with lifecycle_plane.sessions() as session:
        assert session.get_one(Worker, worker_id).status == "training"
