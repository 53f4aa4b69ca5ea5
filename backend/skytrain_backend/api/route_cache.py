"""The gateway's route cache: what an API key and a model name resolved to a moment ago.

Resolving an inference request reads five or six rows (the key and its tenant, the model, its
latest step, the worker and whether it serves that step); under load that is most of the
control plane's cost per request. The answer changes only when one of those rows does, so the
gateway keeps each successful resolution (the tenant, its limits, the ``EngineRoute``) for
``SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S`` (default 1 s), keyed by the key's hash and the model
name as sent. Only ready routes are kept: a request that got 404, 429 or 503 is resolved
again next time.

Invalidation. Every commit in this process that changes a row a route is made of (a key, a
tenant, a model, a checkpoint, a worker) empties every cache in the process at once, before
the commit returns: a step committed, a checkpoint or model deleted, a key revoked, a worker
gone or loading something else. Activity marks (``last_active_at``, ``last_requested_at``,
heartbeats, ``last_used_at``) and the demand per replica the scheduler notes change nothing a
route holds and do not count. A resolution that
was running while the cache was emptied is not kept (it may have read the old rows).

Across processes on one database (other replicas, and the CLI: ``skytrain keys revoke``) a
change made through another process is seen
here within the TTL: for at most that long a request may still go to a deleted model's worker
(whose engine still holds the adapter until the scheduler unloads it) or to the previous step.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from sqlalchemy import event, inspect
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction

from skytrain_backend.db.models import ApiKey, Checkpoint, Model, ModelReplica, Tenant, Worker

# Rows routes are made of, and their columns whose changes do not alter a route (activity
# marks, and the demand the scheduler writes for `skytrain models show`).
_WATCHED: tuple[type[Any], ...] = (ApiKey, Tenant, Model, ModelReplica, Checkpoint, Worker)
_ACTIVITY_MARKS = frozenset(
    {
        "last_active_at",
        "last_requested_at",
        "last_heartbeat_at",
        "last_used_at",
        "updated_at",
        "demand_per_replica",
    }
)
_CHANGED = "skytrain_route_change"

V = TypeVar("V")


class RouteCache(Generic[V]):
    """A TTL map, emptied by any commit in the process that changes a watched row."""

    def __init__(self, *, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[Hashable, tuple[float, V]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        _caches.add(self)

    @property
    def generation(self) -> int:
        """Read before resolving; pass to ``put`` so a result read across a change is dropped."""
        return self._generation

    def get(self, key: Hashable) -> V | None:
        held = self._entries.get(key)
        if held is None:
            return None
        expires, value = held
        if time.monotonic() >= expires:
            self._entries.pop(key, None)
            return None
        return value

    def put(self, key: Hashable, value: V, *, generation: int) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if generation == self._generation:
                self._entries[key] = (time.monotonic() + self.ttl_s, value)

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries = {}


_caches: weakref.WeakSet[RouteCache[Any]] = weakref.WeakSet()


def _clear_all() -> None:
    for cache in list(_caches):
        cache.clear()


def _changes_a_route(instance: object, *, dirty: bool) -> bool:
    if not isinstance(instance, _WATCHED):
        return False
    if not dirty:
        return True
    state = inspect(instance)
    for attribute in state.attrs:
        if attribute.key in _ACTIVITY_MARKS:
            continue
        history = attribute.history
        # A heartbeat writes the same served list again: no change to a route.
        if history.has_changes() and list(history.added) != list(history.deleted):
            return True
    return False


@event.listens_for(Session, "after_flush")
def _note_flush(session: Session, _flush: UOWTransaction) -> None:
    if session.info.get(_CHANGED):
        return
    if (
        any(_changes_a_route(row, dirty=False) for row in session.new)
        or any(_changes_a_route(row, dirty=False) for row in session.deleted)
        or any(_changes_a_route(row, dirty=True) for row in session.dirty)
    ):
        session.info[_CHANGED] = True


@event.listens_for(Session, "do_orm_execute")
def _note_bulk(state: ORMExecuteState) -> None:
    mapper = state.bind_mapper
    if (state.is_update or state.is_delete) and mapper and issubclass(mapper.class_, _WATCHED):
        state.session.info[_CHANGED] = True


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    if session.info.pop(_CHANGED, False):
        _clear_all()


@event.listens_for(Session, "after_soft_rollback")
def _after_rollback(session: Session, _previous: Any) -> None:
    session.info.pop(_CHANGED, None)
