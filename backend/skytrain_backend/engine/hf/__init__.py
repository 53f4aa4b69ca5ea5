"""skytrain's CPU engine: transformers + peft behind a continuous-batching decode loop.

- ``server`` — the HTTP server, vLLM's routes and errors (``python -m skytrain_backend.engine``).
- ``openai_api.OpenAIServing`` — OpenAI chat completions and completions over the engine.
- ``toolcalls`` — Hermes-format tool calls parsed out of the generated text.
- ``engine.HFEngine`` — the asyncio API the HTTP server calls (generate, adapters, sleep).
- ``requests`` — what the engine thread works on: requests, their fair queue, the batch.
- ``runner.ModelRunner`` — the model, its LoRA adapters and the forward pass.
- ``sampling``, ``detokenizer``, ``kvcache`` — the small pieces of the decode loop.
"""
