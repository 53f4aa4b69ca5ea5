"""Which replica of a model a request goes to (``scheduler/replicas.py`` places them).

- **Least outstanding requests**: among the route's replicas (the engines serving the asked
  step: ``scheduler.routing``), the one this gateway has the fewest requests in flight on;
  ties go round the replicas in turn.
- **Affinity**: a request carrying a conversation (the OpenAI ``user`` field, or an
  ``X-Session-Id`` header) goes to the replica the conversation's last request went to, so a
  multi-turn rollout reuses that engine's prefix cache, while that replica is among the
  route's and healthy; otherwise it is placed as any request and the conversation follows it.
  Each tenant's conversations are remembered apart, ``AFFINITY_ENTRIES_PER_TENANT`` at most
  (its least recently used forgotten first): a tenant with many conversations forgets only
  its own, never another tenant's.
- **A replica that cannot be reached** (the request never reached it: the connection failed),
  or whose engine refuses it with a 503 before generating (``Gateway._send``), is left
  out for ``DOWN_S`` and the request goes to another replica. Once an engine has
  begun answering, the request is never sent elsewhere: a stream already started is never
  replayed.

Counts are this process's (each control plane balances its own requests); the same counts,
per model, are the demand the scheduler scales replicas by (``scheduler.demand``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from skytrain_backend.scheduler.demand import DemandMeter, release_once
from skytrain_backend.scheduler.routing import EngineRoute

# How long a replica that could not be reached is left out of its model's choices.
DOWN_S = 5.0
# Conversations remembered per tenant (its least recently used forgotten first).
AFFINITY_ENTRIES_PER_TENANT = 10_000
SESSION_HEADER = "X-Session-Id"


class Balancer:
    def __init__(self, demand: DemandMeter) -> None:
        self.demand = demand
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        # Per tenant: (model id, conversation) -> the worker its last request went to.
        self._affinity: dict[str, OrderedDict[tuple[str, str], str]] = {}
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()

    def outstanding(self, worker_id: str) -> int:
        with self._lock:
            return self._outstanding.get(worker_id, 0)

    def pick(
        self,
        route: EngineRoute,
        *,
        tenant_id: str,
        conversation: str | None,
        exclude: Collection[str] = (),
    ) -> EngineRoute | None:
        """The replica for a request of ``tenant_id`` (None: every one was excluded)."""
        choices = [choice for choice in route.choices if choice.worker_id not in exclude]
        if not choices:
            return None
        now = time.monotonic()
        with self._lock:
            healthy = [c for c in choices if self._down_until.get(c.worker_id, 0.0) <= now]
            # Every replica left out: try them anyway (one may be back).
            choices = healthy or choices
            key = (route.model_id, conversation) if conversation else None
            remembered = self._affinity.get(tenant_id)
            if key is not None and remembered is not None:
                held = remembered.get(key)
                for choice in choices:
                    if choice.worker_id == held:
                        remembered.move_to_end(key)
                        return choice
            turn = next(self._turn)
            chosen = min(
                enumerate(choices),
                key=lambda item: (
                    self._outstanding.get(item[1].worker_id, 0),
                    (item[0] - turn) % len(choices),
                ),
            )[1]
            if key is not None:
                remembered = self._affinity.setdefault(tenant_id, OrderedDict())
                remembered[key] = chosen.worker_id
                remembered.move_to_end(key)
                while len(remembered) > AFFINITY_ENTRIES_PER_TENANT:
                    remembered.popitem(last=False)
            return chosen

    def begin(self, route: EngineRoute) -> Callable[[], None]:
        """Count a request sent to ``route``'s worker in; the function that counts it out
        (safe to call more than once)."""
        worker_id = route.worker_id
        with self._lock:
            self._outstanding[worker_id] = self._outstanding.get(worker_id, 0) + 1
        end_demand = self.demand.begin(route.model_id, worker_id)

        def count_out() -> None:
            left = self._outstanding[worker_id] - 1
            if left:
                self._outstanding[worker_id] = left
            else:
                del self._outstanding[worker_id]

        counted_out = release_once(self._lock, count_out)

        def end() -> None:
            counted_out()
            end_demand()

        return end

    def unreachable(self, worker_id: str) -> None:
        """The worker's engine could not be reached: leave it out for ``DOWN_S``."""
        with self._lock:
            self._down_until[worker_id] = time.monotonic() + DOWN_S


def conversation_of(body: dict[str, object], headers: dict[str, str] | None) -> str | None:
    """The conversation a request belongs to: ``X-Session-Id``, else the ``user`` field."""
    if headers is not None:
        session = headers.get(SESSION_HEADER.lower()) or headers.get(SESSION_HEADER)
        if session:
            return f"s:{session[:256]}"
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"u:{user[:256]}"
    return None
