"""A queued job reaches the worker waiting for one at the notification of its queuing, not at
the end of a poll: the worker's lease request waits 30 s, and the control plane's own counts
say what woke it (PostgreSQL: ``pg_notify`` in the queuing transaction and the process's
``LISTEN`` connection; SQLite: the commit)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from skytrain_backend.db import notify
from skytrain_backend.worker.client import ControlPlaneClient, until_stopped
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import wait_until
from tests.lifecycle.conftest import OnWorker, Who, WorkerClient, leased_job

LEASE_WAIT_S = 30


@pytest.fixture
def notifier(lifecycle_plane: ServedPlane) -> notify.Notifier:
    """The control plane's notifier: its counts say how each long-poll was woken."""
    notifier: notify.Notifier = lifecycle_plane.app.state.notifier
    return notifier


def test_a_job_queued_while_a_worker_waits_is_leased_at_its_notification(
    on_worker: OnWorker, notifier: notify.Notifier
) -> None:
    alice, model_id, worker = on_worker
    before = Counter(notifier.counts)
    with ThreadPoolExecutor(1) as pool:
        leasing = pool.submit(
            worker.http.post, "/jobs/lease", params={"wait_s": LEASE_WAIT_S}, json={}
        )
        # The request found nothing and waits (the queue is empty)...
        wait_until(lambda: notifier.parked == 1, what="the lease request to wait")
        # ... until a job is queued.
        job_id = alice.queue_job(model_id)
        answer = leasing.result()

    assert answer.status_code == 200, answer.text
    assert answer.json()["job"]["id"] == job_id
    counts = notifier.counts - before
    # Woken by a notification, never by its 30 s running out; one claim before waiting and
    # one per wake-up (other tests' changes may wake it once more, never more than that).
    assert counts["woken_by_timeout"] == 0
    assert 1 <= counts["woken_by_notification"] <= 2
    assert counts[f"checks/{notify.JOBS}"] == 1 + counts["woken_by_notification"]


def test_a_job_wakes_only_the_worker_its_model_is_placed_on(
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
    notifier: notify.Notifier,
) -> None:
    """Two workers wait; a job of a model on the first wakes the first alone: the second's
    request stays parked and runs no claim query, until a job of its own model comes."""
    alice = who()
    first_model, second_model = (str(alice.create_model()["id"]) for _ in range(2))
    first, second = worker_client(first_model), worker_client(second_model)
    with ThreadPoolExecutor(2) as pool:
        second_leasing = pool.submit(
            second.http.post, "/jobs/lease", params={"wait_s": LEASE_WAIT_S}, json={}
        )
        wait_until(lambda: notifier.parked == 1, what="the second worker's request to wait")
        first_leasing = pool.submit(
            first.http.post, "/jobs/lease", params={"wait_s": LEASE_WAIT_S}, json={}
        )
        wait_until(lambda: notifier.parked == 2, what="both requests to wait")
        before = Counter(notifier.counts)
        first_job = alice.queue_job(first_model)
        assert first_leasing.result().json()["job"]["id"] == first_job
        counts = notifier.counts - before
        # One claim: the first worker's, at its wake-up; the second was not woken.
        assert counts["woken_by_notification"] == 1
        assert counts[f"checks/{notify.JOBS}"] == 1
        assert not second_leasing.done() and notifier.parked == 1

        second_job = alice.queue_job(second_model)
        assert second_leasing.result().json()["job"]["id"] == second_job
    assert (notifier.counts - before)["woken_by_timeout"] == 0


async def test_a_job_claimed_for_a_worker_that_hung_up_goes_back_to_the_queue_uncounted(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
) -> None:
    """The worker hangs up while its lease request claims a job: nobody will read the answer,
    so the job is queued again at once with that attempt uncounted, not held until its lease
    expires (which would also use up one of its attempts)."""
    alice, model_id, worker = on_worker
    job_id = alice.queue_job(model_id)

    # The app called as its server would: the request's body, then the client hangs up
    # (which the long-poll sees before the claim it runs in a thread returns).
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, object]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/worker/jobs/lease",
        "raw_path": b"/v1/worker/jobs/lease",
        "query_string": f"wait_s={LEASE_WAIT_S}".encode(),
        "headers": [
            (b"host", b"control-plane"),
            (b"content-type", b"application/json"),
            (b"authorization", worker.http.headers["Authorization"].encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("control-plane", 80),
        "root_path": "",
    }
    await asyncio.wait_for(lifecycle_plane.app(scope, receive, send), 60)

    assert sent[0]["status"] == 204  # what nobody reads: "no job"
    job = alice.http.get(f"/v1/training-jobs/{job_id}").json()
    assert job["status"] == "queued"
    # Leased again at once, as its first attempt.
    leased = worker.lease()
    assert (leased["id"], leased["attempt"]) == (job_id, 1)


def test_a_lease_request_without_wait_answers_at_once_and_out_of_range_waits_are_refused(
    on_worker: OnWorker,
) -> None:
    worker = on_worker.worker
    assert worker.http.post("/jobs/lease", json={}).status_code == 204
    refused = worker.http.post("/jobs/lease", params={"wait_s": 31}, json={})
    assert refused.status_code == 400, refused.text
    assert "wait_s" in refused.json()["error"]["message"]


def test_a_follower_of_a_jobs_events_gets_the_next_event_at_its_notification(
    on_worker: OnWorker, notifier: notify.Notifier
) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    before = Counter(notifier.counts)
    with ThreadPoolExecutor(1) as pool:
        following = pool.submit(
            alice.http.get, f"/v1/training-jobs/{job_id}/events", params={"wait_s": 30}
        )
        wait_until(lambda: notifier.parked == 1, what="the follower to wait")
        reported = worker.http.post(
            f"/jobs/{job_id}/events",
            json={"attempt": 1, "type": "training_started", "data": {"step": 1}},
        )
        assert reported.status_code == 201, reported.text
        page = following.result().json()

    assert [event["type"] for event in page["data"]] == ["training_started"]
    counts = notifier.counts - before
    assert counts["woken_by_timeout"] == 0
    assert counts["woken_by_notification"] == 1


async def test_a_stopping_worker_drops_its_pending_lease_and_the_control_plane_lets_go(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
    notifier: notify.Notifier,
) -> None:
    alice, model_id, worker = on_worker
    token = worker.http.headers["Authorization"].removeprefix("Bearer ")
    control_plane = ControlPlaneClient(lifecycle_plane.url, token)
    stopping = asyncio.Event()
    try:
        async with asyncio.timeout(120):
            leasing = asyncio.create_task(
                until_stopped(control_plane.lease(wait_s=LEASE_WAIT_S), stopping)
            )
            await asyncio.to_thread(
                wait_until, lambda: notifier.parked == 1, what="the lease request to wait"
            )
            stopping.set()
            # The worker's side ends at once, with no job ...
            assert await leasing is None
            # ... and the control plane stops waiting when it hangs up, without claiming.
            await asyncio.to_thread(
                wait_until, lambda: notifier.parked == 0, what="the control plane to let go"
            )
    finally:
        await control_plane.aclose()
    job_id = alice.queue_job(model_id)
    assert alice.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "queued"
