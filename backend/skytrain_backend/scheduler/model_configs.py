"""Base models' ``config.json`` for the memory plan, on a control plane that may have none.

A base model's config is looked up, in order: on this machine (``find_model_config``: the
model cache, the Hugging Face cache, a model directory), in what this process read before,
in the object store (where every control plane sharing it keeps what it fetched, under a
key derived here from the Hub's address and the model id), and finally on the Hub itself
(``fetch_hub_config``: that one file, with the operator's ``HF_TOKEN`` and ``HF_ENDPOINT``),
whose answer then goes to the object store.

A fetch runs in a thread of its own, one at a time per base model, and a caller waits for
it at most ``SKYTRAIN_HUB_TIMEOUT_S``: a slow Hub holds neither a tenant's request nor the
scheduler's pass longer, and the fetch that goes on in the background leaves its answer for
the next caller. A failure is remembered for ``RETRY_AFTER_S``, so a Hub that is down is not
asked again by every request meanwhile; the scheduler asks again before each launch (which
the launch back-off spaces out: ``SKYTRAIN_WORKER_LAUNCH_BACKOFF_S``).

What this process keeps is bounded, whatever base-model strings tenants send: the
``KNOWN_CONFIGS`` most recently used configs and the ``KNOWN_FAILURES`` latest failures
(each configs up to 1 MiB, ``MAX_CONFIG_BYTES``); the rest are read again from the store.
The store keeps the configs of base models that models name: the scheduler's garbage sweep
deletes the others (``garbage.collect_garbage``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from cachetools import LRUCache, TTLCache

from skytrain_backend.base_models import is_hub_id
from skytrain_backend.config import Settings
from skytrain_backend.errors import ModelConfigUnavailable, SkytrainError
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning.configs import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    fetch_hub_config,
    find_model_config,
)
from skytrain_backend.storage import ObjectStore, keys

logger = logging.getLogger(__name__)

PUBLIC_HUB = "https://huggingface.co"
# How long a failed fetch answers for the Hub before it is asked again.
RETRY_AFTER_S = 30.0
# The configs and failures one process keeps (a config.json is a few KiB, at most 1 MiB).
KNOWN_CONFIGS = 256
KNOWN_FAILURES = 1024


def hub_endpoint(settings: Settings) -> str:
    """The Hub this control plane reads configs from (what their store keys are made of)."""
    return (settings.hub.endpoint or PUBLIC_HUB).rstrip("/")


class ModelConfigs:
    """The control plane's source of base models' config.json (one per process, shared by
    the routes and the scheduler)."""

    def __init__(self, settings: Settings, store: ObjectStore | None) -> None:
        self._settings = settings
        self._store = store
        self._endpoint = hub_endpoint(settings)
        self._lock = threading.Lock()
        self._known: LRUCache[str, JSONObject] = LRUCache(maxsize=KNOWN_CONFIGS)
        self._failed: TTLCache[str, tuple[float, str]] = TTLCache(
            maxsize=KNOWN_FAILURES, ttl=RETRY_AFTER_S
        )
        self._fetches: dict[str, Future[JSONObject]] = {}

    def get(self, base_model: str, *, fresh: bool = False) -> JSONObject | None:
        """``base_model``'s config.json; None for a model directory this machine cannot
        read (its worker reads it). Raises ModelConfigUnavailable when the Hub refused it,
        failed, or has not answered within ``SKYTRAIN_HUB_TIMEOUT_S``.

        ``fresh``: ask the Hub even if it failed less than ``RETRY_AFTER_S`` ago (the
        scheduler, whose launches have their own back-off)."""
        local = find_model_config(
            base_model, cache_dir=self._settings.storage.resolved_model_cache_dir
        )
        if local is not None or not is_hub_id(base_model):
            return local
        with self._lock:
            known = self._known.get(base_model)
            failed = self._failed.get(base_model)
        if known is not None:
            return known
        if not fresh and failed is not None and failed[0] > time.monotonic():
            raise ModelConfigUnavailable(failed[1], retry_after_s=RETRY_AFTER_S)
        stored = self._from_store(base_model)
        if stored is not None:
            with self._lock:
                self._known[base_model] = stored
            return stored
        try:
            return self._fetch(base_model).result(timeout=self._settings.hub.timeout_s)
        except FutureTimeout:
            raise ModelConfigUnavailable(
                f"reading base model {base_model}'s {CONFIG_FILE} from the Hugging Face Hub "
                f"takes longer than {self._settings.hub.timeout_s:g} s: it goes on, and is "
                "asked for again before a worker is launched",
                retry_after_s=RETRY_AFTER_S,
            ) from None

    def _fetch(self, base_model: str) -> Future[JSONObject]:
        """The fetch of ``base_model``'s config in flight, started if none is."""
        with self._lock:
            future = self._fetches.get(base_model)
            if future is not None:
                return future
            future = Future()
            self._fetches[base_model] = future
        threading.Thread(
            target=self._run_fetch, args=(base_model, future), name="skytrain-hub", daemon=True
        ).start()
        return future

    def _run_fetch(self, base_model: str, future: Future[JSONObject]) -> None:
        token = self._settings.hub.token
        try:
            config = fetch_hub_config(
                base_model,
                endpoint=self._settings.hub.endpoint,
                token=token.get_secret_value() if token else None,
                timeout_s=self._settings.hub.timeout_s,
            )
        except ModelConfigUnavailable as exc:
            logger.warning("no %s for %s: %s", CONFIG_FILE, base_model, exc.message)
            with self._lock:
                self._failed[base_model] = (time.monotonic() + RETRY_AFTER_S, exc.message)
                del self._fetches[base_model]
            future.set_exception(exc)
            return
        self._to_store(base_model, config)
        with self._lock:
            self._known[base_model] = config
            self._failed.pop(base_model, None)
            del self._fetches[base_model]
        future.set_result(config)

    def _key(self, base_model: str) -> str:
        return keys.hub_config_key(endpoint=self._endpoint, base_model=base_model)

    def _from_store(self, base_model: str) -> JSONObject | None:
        if self._store is None:
            return None
        try:
            data = self._store.get_bytes(self._key(base_model))
        except SkytrainError:  # not there yet, or the store is out of reach: ask the Hub
            return None
        try:
            config = json.loads(data) if len(data) <= MAX_CONFIG_BYTES else None
        except ValueError:
            config = None
        return config if isinstance(config, dict) else None

    def _to_store(self, base_model: str, config: JSONObject) -> None:
        if self._store is None:
            return
        try:
            self._store.put_bytes(self._key(base_model), json.dumps(config).encode())
        except SkytrainError as exc:  # planning goes on; the next process asks the Hub
            logger.warning("could not keep %s's %s: %s", base_model, CONFIG_FILE, exc.message)
