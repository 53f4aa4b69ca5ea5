"""Each tenant's requests in flight, counted against its limits (``db.tenants``).

An inference request holds a ``Load`` (``db.tenant_loads``: one request, its sequences, its tokens)
from admission until its answer ends; a REST request (``api/admission/rest_admission.py``) holds
one REST request until the app has answered it. The gateway and the REST routes each count with a
``TenantLoads`` of their own. ``TenantLoads.admit`` counts a request in, or raises ``RateLimited``
naming the limit it would pass (after waiting, in order of arrival and holding nothing, up to its
``wait_s`` for the tenant's requests in this process to make room: the REST routes wait, the
gateway does not); the function it returns counts it out.

- One process (SQLite, the embedded default): counted in memory.
- PostgreSQL: counted in memory too (a process over a limit on its own refuses at once), and
  in the database across every control-plane process on it (``db.tenant_loads``): a tenant at
  its limit through one process is refused through any other. Each admission is one short
  transaction; releases are written together, those that end while the last ones are being
  written in the next transaction (until written, the slot stays held, never the other way
  round). Rows are leased for ``LEASE_S`` and renewed every ``RENEW_S``: the load of a process
  that was killed is freed within ``LEASE_S``.

The REST requests of one process also share its places (``process_places``): past them, a
tenant holding more than its share (the places over the tenants with requests in flight) waits
like a tenant past its own cap, then gets 429; a tenant with nothing in flight is always let
in. Eight tenants bursting at once then keep as much work in flight as one does, so a ninth's
request waits behind that, not behind eight times it. A long-poll does not count against the
places while it waits (``Admitted.park``): it holds no CPU then; its checks and its answer do.

A tenant cannot tie up what others use: a process sends one admission per tenant at a time to the
database (the others of that tenant wait in memory, holding nothing), and admissions and renewals
run on threads of their own, not the pool the routes share, taken in turns (``FairLimiter``): the
next turn goes to a tenant with no other request waiting to be counted in (then the one with the
fewest admitted and in flight), bursting tenants in turn. Releases are written on a thread of their
own, one transaction at a time. The REST routes' counter admits one request at a time
(``REST_COUNTING_TURNS``): a tenant's admissions are one at a time anyway, so eight tenants
bursting at once cost the database, and the cores it shares with the process, what one tenant's
burst does (one admission and one write of releases at a time), and a tenant with nothing in flight
waits for at most the admission running. With four at a time, eight tenants' bursts kept four
admissions and their releases running beside a quiet tenant's, which slowed it 8x where one
tenant's burst slowed it 2x (bench/README.md). The gateway's counter admits ``DB_THREADS`` at a
time: inference is admitted per request, at a rate one transaction at a time would cap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import uuid
from collections.abc import Callable, Hashable

import anyio
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.errors import database_outage
from skytrain_backend.db import tenant_loads
from skytrain_backend.db.tenant_loads import Load
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import RateLimited, Unavailable

logger = logging.getLogger(__name__)

LEASE_S = 15.0
RENEW_S = 5.0
# Admissions (and so threads and database connections) a ``TenantLoads`` counts at once by
# default (the gateway's); the REST routes' counts one at a time (``REST_COUNTING_TURNS``).
# Each also writes its releases, one transaction at a time, on a thread of its own.
DB_THREADS = 4
REST_COUNTING_TURNS = 1


# What one REST request without a body holds.
REST_REQUEST = Load(rest_requests=1)


def rest_cost(body_bytes: int, *, bytes_per_request: int, limit: int) -> Load:
    """What a REST request with a body of ``body_bytes`` holds: one request, plus one per
    started ``bytes_per_request`` of its body, at most ``limit`` (so that it fits alone)."""
    extra = -(-body_bytes // bytes_per_request)
    return Load(rest_requests=max(1, min(1 + extra, limit)))


def check_admission(held: Load, *, cost: Load, limits: TenantLimits) -> None:
    """Raise ``RateLimited`` if adding ``cost`` to ``held`` passes one of ``limits`` (only the
    limits of what ``cost`` counts: a tenant's inference load never refuses its REST requests,
    nor the other way round)."""
    limit = limits.max_concurrent_rest_requests
    if cost.rest_requests and held.rest_requests + cost.rest_requests > limit:
        counts = (
            f"your REST requests in flight count {held.rest_requests} and this one "
            f"{cost.rest_requests} (one, plus one per started "
            "SKYTRAIN_REST_ADMISSION_BYTES_PER_REQUEST of its body, 1 MiB by default), over the "
            f"{limit} allowed at once"
            if cost.rest_requests > 1
            else f"{limit} REST requests of yours are in flight, the most allowed at once"
        )
        raise RateLimited(
            f"{counts} (SKYTRAIN_TENANT_MAX_CONCURRENT_REST_REQUESTS, or your "
            "tenant's max_concurrent_rest_requests; a long-poll counts while it waits): wait "
            "for some to finish, or lower your client's concurrency",
            limit="max_concurrent_rest_requests",
        )
    if cost.requests and held.requests >= limits.max_concurrent_requests:
        raise RateLimited(
            f"{limits.max_concurrent_requests} inference requests of yours are in flight, "
            "the most allowed at once (SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS, or your "
            "tenant's max_concurrent_requests): wait for some to finish, or lower your "
            "client's concurrency",
            limit="max_concurrent_requests",
        )
    if cost.sequences and held.sequences + cost.sequences > limits.max_sequences_in_flight:
        raise RateLimited(
            f"{held.sequences} sequences of yours are being generated and this request "
            f"adds {cost.sequences}, over the {limits.max_sequences_in_flight} allowed at "
            "once (max_sequences_in_flight): wait for some to finish, or lower n",
            limit="max_sequences_in_flight",
        )
    if cost.tokens and held.tokens + cost.tokens > limits.max_tokens_in_flight:
        raise RateLimited(
            f"your requests in flight count {held.tokens} tokens and this one "
            f"{cost.tokens}, over the {limits.max_tokens_in_flight} allowed at once "
            "(max_tokens_in_flight: body bytes plus n x max_tokens): wait for some to "
            "finish, or lower max_tokens",
            limit="max_tokens_in_flight",
        )


def check_share(held: int, *, cost: int, total: int, busy: int, places: int) -> None:
    """Raise ``RateLimited`` if a tenant holding ``held`` of the process's REST places may not
    take ``cost`` more: the process holds ``total`` and ``busy`` tenants hold some (this one
    counted). Within the places, or within its share of them, or holding none: it may."""
    share = max(1, places // busy)
    if total + cost <= places or held == 0 or held + cost <= share:
        return
    raise RateLimited(
        f"this control-plane process is busy: its {places} places for REST requests "
        f"(SKYTRAIN_REST_ADMISSION_PROCESS_PLACES) are shared by the tenants using it, and "
        f"yours hold {held} of them, your share while others use it: wait for some to finish, "
        "or lower your client's concurrency",
        limit="rest_admission_process_places",
    )


class Admitted:
    """One request counted in. Calling it counts it out (safe twice); ``park(True)`` stops it
    counting against the process's shared places while it waits with nothing to do,
    ``park(False)`` counts it in again (without a check: it was admitted) once it has work."""

    def __init__(self, release: Callable[[], None], park: Callable[[bool], None]) -> None:
        self._release = release
        self.park = park

    def __call__(self) -> None:
        self._release()


class TenantLoads:
    """Requests in flight per tenant; across processes when ``shared`` (PostgreSQL). With
    ``process_places``, REST requests also share this process's places (above)."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        shared: bool,
        process_places: int | None = None,
        counting_turns: int = DB_THREADS,
    ) -> None:
        self._sessions = sessions
        self._shared = shared
        self._places = process_places
        # REST places held in this process per tenant (parked long-polls not counted).
        self._placed: dict[str, int] = {}
        self.holder = uuid.uuid4().hex
        self._in_flight: dict[str, Load] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        # Releases the database did not take, written at the next renewal.
        self._unwritten: dict[str, Load] = {}
        # Releases not written yet, and the task that will write them (all in one transaction,
        # once the one writing the releases before them has ended).
        self._unreleased: dict[str, Load] = {}
        self._writing_releases: asyncio.Task[None] | None = None
        self._release_turn = asyncio.Lock()
        self._release_thread: anyio.CapacityLimiter | None = None  # made on the event loop
        self._admitting: dict[str, asyncio.Lock] = {}
        # Releases being written, per tenant: an admission the database refuses waits for them
        # and asks again, so a client's next request after an answer ended is never refused
        # for the slot that answer held.
        self._releasing: dict[str, set[asyncio.Task[None]]] = {}
        # Requests waiting for room, per tenant, in order of arrival (``admit``'s wait_s).
        self._waiters: dict[str, collections.deque[asyncio.Event]] = {}
        # Taken in turns by tenant (``_rank``): one tenant's admissions never queue in front of
        # another's, and a tenant with no backlog waits for at most the transactions running.
        self._threads = FairLimiter(total=counting_turns, per_key=counting_turns, rank=self._rank)
        # Per tenant, requests waiting to be counted in by the database, and those counted in
        # and not yet out (the turns' rank).
        self._to_admit: dict[str, int] = {}
        self._admitted: dict[str, int] = {}

    def _rank(self, key: Hashable) -> tuple[int, int]:
        """A tenant with no other request waiting to be counted in first, then the one with the
        fewest admitted. A burst ranks after every quiet tenant however small its backlog, and
        among bursts the backlog does not count: a larger one never waits longer."""
        if not isinstance(key, str):
            return 0, 0  # the renewal
        return int(self._to_admit.get(key, 0) > 1), self._admitted.get(key, 0)

    @staticmethod
    def _count(counts: dict[str, int], tenant_id: str, delta: int) -> None:
        left = counts.get(tenant_id, 0) + delta
        if left:
            counts[tenant_id] = left
        else:
            del counts[tenant_id]

    async def _in_thread(
        self, tenant_id: str | None, function: Callable[..., None], *args: object
    ) -> None:
        await self._threads.run_sync(tenant_id, functools.partial(function, *args))

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._shared and self._renewer is not None:
            with contextlib.suppress(SQLAlchemyError):
                await self._in_thread(None, self._forget)

    def held(self, tenant_id: str) -> Load:
        """What the tenant holds through this process."""
        return self._in_flight.get(tenant_id, Load())

    async def admit(
        self, tenant_id: str, *, limits: TenantLimits, cost: Load, wait_s: float = 0.0
    ) -> Admitted:
        """Count a request in; returns what counts it out (from the event loop). A request over
        a limit in this process waits up to ``wait_s`` (holding nothing) for the tenant's
        requests to finish, in order of arrival."""
        await self._wait_in_turn(tenant_id, limits=limits, cost=cost, wait_s=wait_s)
        self._add(tenant_id, cost)
        self._place(tenant_id, cost.rest_requests)
        if self._shared:
            self._start_renewing()
            lock = self._admitting.setdefault(tenant_id, asyncio.Lock())
            self._count(self._to_admit, tenant_id, 1)
            try:
                async with lock:
                    try:
                        await self._in_thread(tenant_id, self._acquire, tenant_id, limits, cost)
                    except RateLimited:
                        # The database may not have the releases of answers already sent.
                        releasing = self._releasing.get(tenant_id)
                        if not releasing:
                            raise
                        await asyncio.gather(*releasing, return_exceptions=True)
                        await self._in_thread(tenant_id, self._acquire, tenant_id, limits, cost)
            except BaseException:
                self._add(tenant_id, Load() - cost)
                self._place(tenant_id, -cost.rest_requests)
                raise
            finally:
                self._count(self._to_admit, tenant_id, -1)
            self._count(self._admitted, tenant_id, 1)
        released = False
        parked = False

        def park(waiting: bool) -> None:
            nonlocal parked
            if released or parked == waiting:
                return
            parked = waiting
            self._place(tenant_id, -cost.rest_requests if waiting else cost.rest_requests)

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._add(tenant_id, Load() - cost)
            if not parked:
                self._place(tenant_id, -cost.rest_requests)
            waiters = self._waiters.get(tenant_id)
            if waiters:
                waiters[0].set()
            if self._shared:
                self._count(self._admitted, tenant_id, -1)
                task = self._release_later(tenant_id, cost)
                releasing = self._releasing.setdefault(tenant_id, set())
                releasing.add(task)

                def done(task: asyncio.Task[None]) -> None:
                    releasing.discard(task)
                    if not releasing and self._releasing.get(tenant_id) is releasing:
                        del self._releasing[tenant_id]

                task.add_done_callback(done)

        return Admitted(release, park)

    def _place(self, tenant_id: str, delta: int) -> None:
        """Count ``delta`` REST places in (or out) for the tenant; places freed wake the first
        waiter of every tenant, whose share may now let it in."""
        if self._places is None or not delta:
            return
        held = self._placed.get(tenant_id, 0) + delta
        if held:
            self._placed[tenant_id] = held
        else:
            self._placed.pop(tenant_id, None)
        if delta < 0:
            for waiters in self._waiters.values():
                if waiters:
                    waiters[0].set()

    def _check_places(self, tenant_id: str, cost: Load) -> None:
        if self._places is None or not cost.rest_requests:
            return
        held = self._placed.get(tenant_id, 0)
        check_share(
            held,
            cost=cost.rest_requests,
            total=sum(self._placed.values()),
            busy=len(self._placed) + (0 if held else 1),
            places=self._places,
        )

    async def _wait_in_turn(
        self, tenant_id: str, *, limits: TenantLimits, cost: Load, wait_s: float
    ) -> None:
        """Return once ``cost`` fits the tenant's limits in this process; ``RateLimited`` if it
        still does not after ``wait_s``. Requests that wait are let in in order of arrival: one
        that comes later does not pass them."""
        waiters = self._waiters.get(tenant_id)
        if not waiters:
            try:
                check_admission(self.held(tenant_id), cost=cost, limits=limits)
                self._check_places(tenant_id, cost)
                return
            except RateLimited:
                if wait_s <= 0:
                    raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        waiters = self._waiters.setdefault(tenant_id, collections.deque())
        turn = asyncio.Event()
        waiters.append(turn)
        try:
            while True:
                if waiters[0] is turn or loop.time() >= deadline:
                    try:
                        check_admission(self.held(tenant_id), cost=cost, limits=limits)
                        self._check_places(tenant_id, cost)
                        return
                    except RateLimited:
                        if loop.time() >= deadline:
                            raise
                turn.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(turn.wait(), deadline - loop.time())
        finally:
            waiters.remove(turn)
            if waiters:
                waiters[0].set()  # the next in line looks: there may be room for it too
            elif self._waiters.get(tenant_id) is waiters:
                del self._waiters[tenant_id]

    def _add(self, tenant_id: str, delta: Load) -> None:
        left = self.held(tenant_id) + delta
        if left.requests or left.rest_requests:
            self._in_flight[tenant_id] = left
        else:
            self._in_flight.pop(tenant_id, None)

    def _acquire(self, tenant_id: str, limits: TenantLimits, cost: Load) -> None:
        try:
            with self._sessions() as session:
                held = tenant_loads.held(session, tenant_id=tenant_id, holder=self.holder)
                check_admission(held, cost=cost, limits=limits)
                tenant_loads.add(
                    session,
                    tenant_id=tenant_id,
                    holder=self.holder,
                    delta=cost,
                    lease_s=LEASE_S,
                )
                session.commit()
        except SQLAlchemyError as exc:
            logger.warning("counting a request of tenant %s failed: %s", tenant_id, exc)
            outage = database_outage(exc)
            if outage is not None:
                raise outage from exc
            raise Unavailable(
                "the control plane could not count your request against your limits (its "
                "database did not answer): retry shortly",
                retry_after_s=2.0,
            ) from exc

    def _release_later(self, tenant_id: str, cost: Load) -> asyncio.Task[None]:
        """Count ``cost`` out of the database with the other releases not written yet; the
        task that writes them."""
        self._unreleased[tenant_id] = self._unreleased.get(tenant_id, Load()) - cost
        if self._writing_releases is None:
            task = asyncio.get_running_loop().create_task(self._write_releases())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self._writing_releases = task
        return self._writing_releases

    async def _write_releases(self) -> None:
        # Shielded: releases must be written even while the app shuts down.
        with anyio.CancelScope(shield=True):
            async with self._release_turn:
                # Those released from now on are written by the next task.
                deltas, self._unreleased = self._unreleased, {}
                self._writing_releases = None
                if self._release_thread is None:
                    self._release_thread = anyio.CapacityLimiter(1)
                try:
                    await anyio.to_thread.run_sync(
                        functools.partial(self._write, deltas), limiter=self._release_thread
                    )
                except SQLAlchemyError as exc:
                    # Written with the next renewal; the slots stay held until then.
                    logger.warning("releasing requests of %d tenants failed: %s", len(deltas), exc)
                    for tenant_id, delta in deltas.items():
                        self._unwritten[tenant_id] = self._unwritten.get(tenant_id, Load()) + delta

    def _write(self, deltas: dict[str, Load]) -> None:
        with self._sessions() as session:
            for tenant_id in sorted(deltas):
                tenant_loads.add(
                    session,
                    tenant_id=tenant_id,
                    holder=self.holder,
                    delta=deltas[tenant_id],
                    lease_s=LEASE_S,
                )
            session.commit()

    def _start_renewing(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            await anyio.sleep(RENEW_S)
            try:
                await self._in_thread(None, self._renew)
            except SQLAlchemyError as exc:
                logger.warning("renewing the tenants' loads of this process failed: %s", exc)

    def _renew(self) -> None:
        unwritten, self._unwritten = self._unwritten, {}
        try:
            with self._sessions() as session:
                for tenant_id, delta in unwritten.items():
                    tenant_loads.add(
                        session,
                        tenant_id=tenant_id,
                        holder=self.holder,
                        delta=delta,
                        lease_s=LEASE_S,
                    )
                tenant_loads.renew(session, holder=self.holder, lease_s=LEASE_S)
        except SQLAlchemyError:
            for tenant_id, delta in unwritten.items():
                self._unwritten[tenant_id] = self._unwritten.get(tenant_id, Load()) + delta
            raise

    def _forget(self) -> None:
        with self._sessions() as session:
            tenant_loads.forget(session, holder=self.holder)
