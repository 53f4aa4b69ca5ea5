"""The inference gateway: OpenAI chat completions and completions for the caller's models.

One package, one job per module:

- ``admission.py``: the request's body checked against its ranges, and what it costs against
  the tenant's limits on requests, sequences and tokens in flight;
- ``resolver.py``: the key's tenant, the model's checkpoint and the worker serving it,
  cached per key and model (``api/route_cache.py``), loading waited for;
- ``upstream.py``: the aiohttp clients of the worker engines, TLS pinned per worker;
- ``answers.py``: the engine's JSON or server-sent events rewritten for the caller, and its
  refusals said in skytrain's words;
- ``service.py``: the ``Gateway`` that puts them together, one per app.
"""

from skytrain_backend.api.gateway.admission import CHAT, COMPLETIONS, Endpoint
from skytrain_backend.api.gateway.resolver import RESOLVE_CONCURRENCY
from skytrain_backend.api.gateway.service import Gateway

__all__ = ["CHAT", "COMPLETIONS", "RESOLVE_CONCURRENCY", "Endpoint", "Gateway"]
