"""The Tinker protocol's runs on the scheduler's side, one job per module:

- ``runs.py``: training runs (a model and a ``tinker`` job), their ordered operation queue,
  ``tinker://`` names, and their end with their session;
- ``worker_ops.py``: what a worker's Tinker executor runs: leases, rebuild plans, the next
  operation, results, failures and saves;
- ``futures.py``: where a pending future stands, and why, for ``retrieve_future``.
"""
