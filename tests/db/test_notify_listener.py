"""The PostgreSQL notification listener survives losing its connection: a waiter parked while
it was gone is woken when it is back (it may have missed something), and notifications reach
waiters again afterwards. The connection is killed for real, with ``pg_terminate_backend``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sqlalchemy import text

from skytrain_backend.db import notify
from skytrain_backend.db.session import create_db_engine

pytestmark = [pytest.mark.postgres]

WAIT_S = 60.0


async def test_the_listener_reconnects_after_its_connection_is_killed(
    make_postgres_url: Callable[[], str],
) -> None:
    url = make_postgres_url()
    engine = create_db_engine(url)
    notifier = notify.Notifier(url)
    await notifier.start()
    try:
        await asyncio.wait_for(notifier.listening.wait(), WAIT_S)
        parked = notifier.ticket(notify.JOBS)

        def kill_listener() -> bool:
            with engine.begin() as connection:
                killed = connection.execute(
                    text("SELECT pg_terminate_backend(:pid)"), {"pid": notifier.listener_pid}
                ).scalar_one()
            return bool(killed)

        assert await asyncio.to_thread(kill_listener)
        # Woken by the reconnection: whatever was sent meanwhile is lost, so it looks again.
        assert await notifier.wait(parked, WAIT_S)
        assert notifier.counts["listener_disconnects"] == 1
        assert notifier.counts["listener_connects"] == 2

        # Notifications flow again.
        ticket = notifier.ticket(notify.EVENTS, "job-1")

        def send() -> None:
            with engine.begin() as connection:
                connection.execute(
                    text("SELECT pg_notify(:channel, 'job-1')"), {"channel": notify.EVENTS}
                )

        await asyncio.to_thread(send)
        assert await notifier.wait(ticket, WAIT_S)
        assert notifier.counts[f"notified/{notify.EVENTS}"] == 1
    finally:
        await notifier.stop()
        engine.dispose()
