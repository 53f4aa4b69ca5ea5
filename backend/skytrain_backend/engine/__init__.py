"""Inference engines and the client that drives them.

- ``client.EngineClient`` — async client of an engine (health, adapters, sleep/wake).
- ``launcher`` — start an engine subprocess, wait for ``/health``, fail fast with its log.
- ``options`` — ``EngineOptions`` and the automatic choice of engine (vLLM with CUDA, else hf).
- ``vllm`` — the ``vllm serve`` command line.
- ``wire`` — the request and response bodies both engines speak.
- ``hf/`` — skytrain's CPU engine (its server, OpenAI layer, tool calls and decode loop): the
  same HTTP surface as ``vllm serve``, on transformers + peft.

Nothing is imported here, so ``import skytrain_backend.engine.client`` stays light.
"""
