"""A model's demand: the requests the gateway has in flight for it, per worker, and their
time-weighted average over a window, which the scheduler's replica policy reads
(``replicas.py``).

One meter per control-plane process, shared by its gateway (which counts requests in and out)
and its scheduler (which reads it). A request counts from the moment its worker is chosen to
the end of its answer (a stream's last event). The average is exact: the count's integral
over time, kept in slices of one scheduling pass.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Slices older than this are forgotten (no window is longer: settings.scheduler.replica_window_s).
KEPT_S = 3600.0


def release_once(lock: threading.Lock, release: Callable[[], None]) -> Callable[[], None]:
    """A function that runs ``release`` under ``lock`` the first time it is called, and does
    nothing after: a count taken in, counted out once however often its end is called."""
    done = False

    def end() -> None:
        nonlocal done
        with lock:
            if done:
                return
            done = True
            release()

    return end


@dataclass
class _ModelDemand:
    in_flight: int = 0
    since: float = 0.0  # when in_flight last changed (or was last sliced)
    area: float = 0.0  # integral of in_flight since the last slice
    # (start, end, integral of in_flight from start to end), oldest first
    slices: deque[tuple[float, float, float]] = field(default_factory=deque)
    sliced_at: float = 0.0  # where the next slice starts


class DemandMeter:
    """Requests in flight per model and worker, and each model's average over a window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.started = clock()
        self._models: dict[str, _ModelDemand] = {}
        self._per_worker: dict[tuple[str, str], int] = {}

    def begin(self, model_id: str, worker_id: str) -> Callable[[], None]:
        """Count a request for ``model_id`` sent to ``worker_id`` in; the function (safe to
        call more than once) that counts it out."""
        with self._lock:
            self._change(model_id, +1)
            key = (model_id, worker_id)
            self._per_worker[key] = self._per_worker.get(key, 0) + 1

        def count_out() -> None:
            self._change(model_id, -1)
            left = self._per_worker[key] - 1
            if left:
                self._per_worker[key] = left
            else:
                del self._per_worker[key]

        return release_once(self._lock, count_out)

    def _change(self, model_id: str, delta: int) -> None:
        now = self._clock()
        demand = self._models.get(model_id)
        if demand is None:
            demand = self._models[model_id] = _ModelDemand(since=now, sliced_at=now)
        demand.area += demand.in_flight * (now - demand.since)
        demand.since = now
        demand.in_flight += delta

    def in_flight(self, model_id: str, worker_id: str | None = None) -> int:
        """Requests in flight now for the model (on ``worker_id``, when given)."""
        with self._lock:
            if worker_id is not None:
                return self._per_worker.get((model_id, worker_id), 0)
            demand = self._models.get(model_id)
            return 0 if demand is None else demand.in_flight

    def average(self, model_id: str, *, window_s: float) -> float | None:
        """The model's requests in flight averaged over the last ``window_s`` (None: this
        process has not counted that long, so the window is not covered yet)."""
        with self._lock:
            now = self._clock()
            if now - self.started < window_s:
                return None
            demand = self._models.get(model_id)
            if demand is None:
                return 0.0
            # Close the open slice, then forget slices the longest window no longer needs.
            demand.area += demand.in_flight * (now - demand.since)
            demand.since = now
            demand.slices.append((demand.sliced_at, now, demand.area))
            demand.sliced_at = now
            demand.area = 0.0
            while demand.slices and demand.slices[0][1] < now - KEPT_S:
                demand.slices.popleft()
            start = now - window_s
            total = 0.0
            for begun, end, area in demand.slices:
                if end <= start:
                    continue
                if begun < start and end > begun:
                    # The slice straddles the window's start: its share inside it.
                    area *= (end - start) / (end - begun)
                total += area
            return total / window_s

    def models(self) -> list[str]:
        """The models this meter has seen requests for."""
        with self._lock:
            return list(self._models)
