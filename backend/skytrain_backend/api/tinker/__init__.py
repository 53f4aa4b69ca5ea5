"""The Tinker protocol's HTTP side: the routes the official ``tinker`` SDK calls (``/api/v1``)
and those a worker's Tinker executor calls (``/v1/worker/tinker``).

One package, one job per module:

- ``training.py``: the SDK's service, session and training routes (``forward_backward``,
  ``optim_step``, saves, loads), and the one ``router`` that gathers the SDK's routes;
- ``sampling.py``: sampling sessions, samplers and ``asample``;
- ``futures.py``: ``retrieve_future``, answering a finished operation, a failure or
  ``try_again``;
- ``rest_client.py``: the REST client's training runs, checkpoints and weights info;
- ``worker_routes.py``: what a worker's Tinker executor calls, in ``protocol/tinker_ops.py``'s
  types;
- ``deps.py``: what the route modules share (the service, path ids, futures);
- ``service.py``: ``TinkerService``, one per app: operations submitted, runs created and
  loaded, sampling tasks and the futures' waits;
- ``completions.py``: a sample as the engines take it (``/v1/completions``) and its answer.

The wire types are ``protocol/tinker_api.py`` (the SDK's JSON), ``protocol/tinker_protobuf.py``
(its protobuf messages) and ``protocol/tinker_ops.py`` (the worker's); the runs, their queue
and what workers run are ``scheduler/tinker/``; the worker's side is ``worker/tinker_runs.py``.
"""
