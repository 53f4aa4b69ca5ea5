"""Admission: what a request must pass before a route does its work, one job per module.

- ``limits.py``: the body's size and how long it may take to arrive, before anything reads it
  (``RequestLimits``, ASGI middleware);
- ``rest_admission.py``: every request but inference authenticated and counted against its
  sender's requests in flight before routing (``RestAdmission``, ASGI middleware, outermost);
- ``auth.py``: API keys and worker tokens checked, cached for a moment, in threads of their
  own, failures rate-limited per client address (``Authenticator``);
- ``tenant_load.py``: each tenant's requests, sequences and tokens in flight against its
  limits, across replicas on PostgreSQL (``TenantLoads``);
- ``fairness.py``: the threads tenants share, taken in turns (``FairLimiter``);
- ``model_rules.py``: the rules a new model meets, whichever protocol creates it.

The inference gateway's own admission (a request's ranges and cost) is
``api/gateway/admission.py``, over ``tenant_load``.
"""
