"""Wake-ups for long-polls: "the job queue changed" and "job J has news".

A worker's lease request and a client following a job's events wait on the control plane
instead of asking again every second. What they wait for is written by some transaction,
possibly in another control-plane process; this module tells the waiters when such a
transaction commits:

- on PostgreSQL the transaction itself runs ``pg_notify`` (so the notification is delivered
  exactly when, and only if, it commits), and each control-plane process keeps one
  ``LISTEN`` connection (psycopg, async) that wakes its own waiters;
- on SQLite (one process) the session's commit wakes the waiters directly.

A notification is only a hint: a woken waiter runs its query again (the lease is still the
SQL claim, so no job is leased twice), and every wait has a bound (``wait_s``), so a lost
notification costs at most one wait. The listener reconnects when its connection drops
and wakes every waiter once it is back (what was sent meanwhile is lost).

What counts as a change, from the rows a session flushes:

- ``JOBS`` keyed by worker id: a training job inserted or its status changed (a job queued
  or requeued; a running one ended, which frees its model's next job), keyed by the worker
  its model is placed on; or a model placed on a worker, keyed by that worker. Only that
  worker's lease requests wake: a job of a model placed nowhere wakes none (no worker can
  lease it until the scheduler places the model, which is the wake-up). A model moved
  between the job's flush and its commit leaves the new worker to find the job at the end of
  its wait (``wait_s``) or at the model's placement;
- ``EVENTS`` keyed by job id: an event recorded for the job, or its status changed (a
  cancelled queued job ends without an event).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import Counter
from typing import Any

from sqlalchemy import event, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, UOWTransaction, sessionmaker

from skytrain_backend.db.models import Model, TrainingJob, TrainingJobEvent

logger = logging.getLogger(__name__)

JOBS = "skytrain_jobs"
EVENTS = "skytrain_job_events"
CHANNELS = (JOBS, EVENTS)

_PENDING = "skytrain_notify_pending"
# How long the listener waits on an idle connection before checking that it still works.
_PING_TIMEOUT_S = 10.0
_LISTEN_CHECK_S = 30.0
_RECONNECT_MAX_S = 10.0
# The listener's connection as ``pg_stat_activity`` names it.
LISTENER_NAME = f"skytrain-listen {socket.gethostname()}:{os.getpid()}"

Wake = tuple[str, str | None]


def changes(session: Session) -> set[Wake]:
    """The wake-ups the session's pending flush stands for."""
    found: set[Wake] = set()
    changed_jobs: list[TrainingJob] = []
    for row in session.new:
        if isinstance(row, TrainingJob):
            changed_jobs.append(row)
        elif isinstance(row, TrainingJobEvent):
            found.add((EVENTS, row.job_id))
    for row in session.dirty:
        if isinstance(row, TrainingJob) and inspect(row).attrs.status.history.has_changes():
            changed_jobs.append(row)
            found.add((EVENTS, row.id))
        elif (
            isinstance(row, Model)
            and row.worker_id is not None
            and inspect(row).attrs.worker_id.history.has_changes()
        ):
            found.add((JOBS, row.worker_id))
    model_ids = {job.model_id for job in changed_jobs}
    if model_ids:
        found.update((JOBS, worker_id) for worker_id in _workers_of(session, model_ids))
    return found


def _workers_of(session: Session, model_ids: set[str]) -> set[str]:
    """The workers the models are placed on, read in the flushing transaction (a model row
    the session loaded earlier may be out of date: the scheduler moves models)."""
    placed = session.scalars(select(Model.worker_id).where(Model.id.in_(model_ids)))
    return {worker_id for worker_id in placed if worker_id is not None}


class Notifier:
    """Waiters park on a ticket (``ticket(channel, key)``); a change sets the tickets it
    concerns. Counters of what happened are in ``counts`` (tests and logs read them)."""

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        self.postgres = url.get_backend_name() == "postgresql"
        self._dsn = (
            url.set(drivername="postgresql").render_as_string(hide_password=False)
            if self.postgres
            else None
        )
        self._tickets: dict[Wake, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()
        self.counts: Counter[str] = Counter()
        # Waiters parked in ``wait`` right now.
        self.parked = 0
        # Set when the server shuts down: long-polls stop waiting.
        self.closing = False
        # The PostgreSQL backend of the LISTEN connection (the latest one).
        self.listener_pid: int | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.postgres:
            self._listener = asyncio.create_task(self._listen(), name="skytrain-listen")

    async def stop(self) -> None:
        self._close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener

    def close_threadsafe(self) -> None:
        """The server is shutting down: every long-poll answers now (its last check), so
        the shutdown does not wait out the workers' pending lease requests."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        self.closing = True
        self._wake_all()

    def install(self, sessions: sessionmaker[Session]) -> None:
        """Make every session of ``sessions`` announce the changes it commits."""
        event.listen(sessions, "after_flush", self._after_flush)
        if not self.postgres:
            event.listen(sessions, "after_commit", self._after_commit)
            event.listen(sessions, "after_rollback", self._after_rollback)

    # --- waiting -------------------------------------------------------------------------------

    def ticket(self, channel: str, key: str | None = None) -> asyncio.Event:
        """Take this before checking for what you wait for, then ``wait`` on it: a change
        committed in between is not missed."""
        return self._tickets.setdefault((channel, key), asyncio.Event())

    async def wait(self, ticket: asyncio.Event, timeout_s: float) -> bool:
        """True when woken by a change, False when ``timeout_s`` passed first."""
        self.counts["waits"] += 1
        self.parked += 1
        try:
            await asyncio.wait_for(ticket.wait(), timeout_s)
        except TimeoutError:
            self.counts["woken_by_timeout"] += 1
            return False
        finally:
            self.parked -= 1
        self.counts["woken_by_notification"] += 1
        return True

    # --- waking --------------------------------------------------------------------------------

    def _wake(self, channel: str, key: str | None) -> None:
        """On the event loop: set the tickets of ``channel`` with ``key`` and the channel-wide
        one (key None)."""
        self.counts[f"notified/{channel}"] += 1
        for wake in ((channel, key), (channel, None)):
            ticket = self._tickets.pop(wake, None)
            if ticket is not None:
                ticket.set()

    def _wake_all(self) -> None:
        tickets, self._tickets = self._tickets, {}
        for ticket in tickets.values():
            ticket.set()

    def _wake_threadsafe(self, wakes: set[Wake]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for channel, key in wakes:
            loop.call_soon_threadsafe(self._wake, channel, key)

    def _after_flush(self, session: Session, _context: UOWTransaction) -> None:
        found = changes(session)
        if not found:
            return
        if self.postgres:
            # Sent by the server when (and only if) this transaction commits.
            connection = session.connection()
            for channel, key in found:
                connection.execute(
                    text("SELECT pg_notify(:channel, :key)"), {"channel": channel, "key": key or ""}
                )
        else:
            session.info.setdefault(_PENDING, set()).update(found)

    def _after_commit(self, session: Session) -> None:
        found = session.info.pop(_PENDING, None)
        if found:
            self._wake_threadsafe(found)

    def _after_rollback(self, session: Session) -> None:
        session.info.pop(_PENDING, None)

    # --- PostgreSQL ----------------------------------------------------------------------------

    async def _listen(self) -> None:
        """One LISTEN connection for this process, reconnected (with backoff) when it drops."""
        import psycopg

        assert self._dsn is not None
        delay_s = 0.2
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True, application_name=LISTENER_NAME
                ) as connection:
                    for channel in CHANNELS:
                        await connection.execute(f"LISTEN {channel}")
                    self.listener_pid = connection.info.backend_pid
                    self.counts["listener_connects"] += 1
                    self.listening.set()
                    delay_s = 0.2
                    # Whatever was notified while not listening is lost: everyone looks again.
                    self._wake_all()
                    await self._deliver(connection)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning(
                    "the database notification listener lost its connection (%s); waiters "
                    "fall back to their timeouts until it is back",
                    type(exc).__name__,
                )
            self.listening.clear()
            self.counts["listener_disconnects"] += 1
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _RECONNECT_MAX_S)

    async def _deliver(self, connection: Any) -> None:
        while True:
            async for notification in connection.notifies(timeout=_LISTEN_CHECK_S):
                self._wake(notification.channel, notification.payload or None)
            # Idle for a while: make sure the connection still answers (a half-open one
            # would not, and would never fail on its own: reconnect after _PING_TIMEOUT_S).
            await asyncio.wait_for(connection.execute("SELECT 1"), _PING_TIMEOUT_S)
