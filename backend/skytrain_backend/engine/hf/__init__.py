"""skytrain's CPU engine: transformers + peft behind a continuous-batching decode loop.

- ``engine.HFEngine`` — the asyncio API the HTTP server calls (generate, adapters, sleep).
- ``runner.ModelRunner`` — the model, its LoRA adapters and the forward pass.
- ``sampling``, ``detokenizer``, ``kvcache`` — the small pieces of the decode loop.
"""
