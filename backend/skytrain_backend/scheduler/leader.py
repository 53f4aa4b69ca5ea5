"""Which control-plane process runs the scheduler: one at a time per database.

Any number of ``skytrain serve`` processes (or uvicorn workers) may share one PostgreSQL
database. Each runs a ``Scheduler``, but only the one that holds the leadership runs passes
(provisioning, lease expiry, placement, idle stops); the others serve the API and try again
at every pass.

- PostgreSQL: a session-level advisory lock, held on a connection of its own. The lock lasts
  as long as that connection: a leader that exits, crashes or is killed (SIGKILL) drops it,
  PostgreSQL releases the lock at once, and a follower takes it at its next try. A leader
  whose connection broke stops acting at its next pass. TCP keepalives on both ends of the
  connection bound how long a leader whose host vanished without closing it (power loss, a
  partition) keeps the lock: about ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT *
  KEEPALIVE_INTERVAL_S`` seconds. The key is derived from the database's schema, so
  deployments in different schemas of one database do not contend.
- SQLite: one process per database file (the embedded setup) is always the leader.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from abc import ABC, abstractmethod

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

logger = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
# pg_stat_activity shows it, so an operator can see which host leads: the prefix, the schema's
# tag (``schema_tag``), then ``host:pid``.
APPLICATION_NAME_PREFIX = "skytrain-scheduler"


def process_name() -> str:
    """This process as logs and ``pg_stat_activity`` name it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Leadership(ABC):
    """Whether this process may run the scheduler's passes."""

    @abstractmethod
    def hold(self) -> bool:
        """Take the leadership if it is free, or confirm it is still held; whether this
        process leads now. Never raises: an unreachable database means not leading."""

    @abstractmethod
    def release(self) -> None:
        """Give the leadership up (at shutdown), so another process takes over at once."""


class SoleLeadership(Leadership):
    """The only scheduler on its database (SQLite): always the leader."""

    def hold(self) -> bool:
        return True

    def release(self) -> None:
        return None


class AdvisoryLockLeadership(Leadership):
    """A PostgreSQL session-level advisory lock on a dedicated connection."""

    def __init__(self, database_url: str) -> None:
        self._engine: Engine = create_engine(
            make_url(database_url),
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={
                # Until the schema is known (set again once connected, with its tag).
                "application_name": f"{APPLICATION_NAME_PREFIX} {process_name()}"[:63],
                "connect_timeout": 10,
                # This end: a server that vanished breaks the connection, and the leader steps
                # down, instead of waiting on it for hours.
                "keepalives": 1,
                "keepalives_idle": KEEPALIVE_IDLE_S,
                "keepalives_interval": KEEPALIVE_INTERVAL_S,
                "keepalives_count": KEEPALIVE_COUNT,
            },
        )
        self._connection: Connection | None = None
        self._key: int | None = None
        self._held = False

    def hold(self) -> bool:
        try:
            if self._connection is None:
                self._connection = self._connect()
            if self._held:
                # The lock lives as long as the session: a live connection still holds it.
                self._connection.execute(text("SELECT 1"))
            else:
                self._held = bool(
                    self._connection.scalar(
                        text("SELECT pg_try_advisory_lock(:key)"), {"key": self._key}
                    )
                )
        except SQLAlchemyError as exc:
            if self._held:
                logger.warning("the scheduler's lock connection broke: %s", exc)
            self._drop()
        return self._held

    def release(self) -> None:
        if self._connection is not None and self._held:
            try:
                self._connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": self._key}
                )
            except SQLAlchemyError as exc:
                logger.warning(
                    "could not release the scheduler's lock (it ends with the connection): %s", exc
                )
        self._drop()
        self._engine.dispose()

    def _connect(self) -> Connection:
        connection = self._engine.connect()
        try:
            # The other end: PostgreSQL ends the session (and frees the lock) of a leader
            # whose host vanished.
            connection.execute(text(f"SET tcp_keepalives_idle = {KEEPALIVE_IDLE_S}"))
            connection.execute(text(f"SET tcp_keepalives_interval = {KEEPALIVE_INTERVAL_S}"))
            connection.execute(text(f"SET tcp_keepalives_count = {KEEPALIVE_COUNT}"))
            if self._key is None:
                self._key = lock_key(str(connection.scalar(text("SELECT current_schema()"))))
            connection.execute(
                text("SELECT set_config('application_name', :name, false)"),
                {"name": application_name(self._key)},
            )
        except BaseException:
            connection.close()
            raise
        return connection

    def _drop(self) -> None:
        self._held = False
        if self._connection is not None:
            try:
                self._connection.close()
            except SQLAlchemyError:
                logger.debug("closing a broken lock connection failed", exc_info=True)
            self._connection = None


def lock_key(schema: str) -> int:
    """The advisory lock's key for a schema: a signed 64-bit integer, stable across
    processes and versions (advisory locks are already scoped to one database)."""
    digest = hashlib.blake2b(f"skytrain.scheduler/{schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def schema_tag(key: int) -> str:
    """A schema's short name in ``pg_stat_activity``: its lock key's first 8 hex digits, so
    deployments in other schemas of one database tell their schedulers apart."""
    return f"{key % 2**64:016x}"[:8]


def application_name(key: int) -> str:
    """A scheduler's lock connection as ``pg_stat_activity`` shows it (63 characters at most)."""
    return f"{APPLICATION_NAME_PREFIX} {schema_tag(key)} {process_name()}"[:63]


def open_leadership(database_url: str) -> Leadership:
    """The leadership the database allows: an advisory lock on PostgreSQL, else sole."""
    if make_url(database_url).get_backend_name() == "postgresql":
        return AdvisoryLockLeadership(database_url)
    return SoleLeadership()
