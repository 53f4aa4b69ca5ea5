"""Object keys, built here and only here from ids the server generated.

No key ever contains text a client chose, so a request cannot name another tenant's objects
or a path outside the store. Everything a tenant owns lives under ``tenants/{tenant_id}/``;
what the control plane keeps for every tenant (base models' config.json) under ``hub/``.
"""

from __future__ import annotations

import hashlib

# Where every key starts.
TENANTS_PREFIX = "tenants/"


def tenant_prefix(tenant_id: str) -> str:
    return f"{TENANTS_PREFIX}{tenant_id}/"


def model_prefix(*, tenant_id: str, model_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}models/{model_id}/"


def checkpoint_prefix(*, tenant_id: str, model_id: str, step: int) -> str:
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}checkpoints/{step}/"


def checkpoint_key(*, tenant_id: str, model_id: str, step: int, file: str) -> str:
    return checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step) + file


def job_input_key(*, tenant_id: str, model_id: str, job_id: str) -> str:
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}jobs/{job_id}/input.jsonl"


def log_key(*, tenant_id: str, model_id: str, batch_id: str) -> str:
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}logs/{batch_id}.jsonl"


def file_key(*, tenant_id: str, file_id: str) -> str:
    return f"{tenant_prefix(tenant_id)}files/{file_id}.jsonl"


def tinker_op_key(*, tenant_id: str, model_id: str, seq_id: int, name: str) -> str:
    """A Tinker operation's input or output (``input.pb``, ``output.pb``)."""
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}tinker/ops/{seq_id}/{name}"


def hub_config_key(*, endpoint: str, base_model: str) -> str:
    """Where the control plane keeps a base model's config.json read from the Hub at
    ``endpoint``: named by a digest, so neither the id nor the Hub's address is in the key."""
    digest = hashlib.sha256(f"{endpoint}\n{base_model}".encode()).hexdigest()
    return f"hub/configs/{digest}.json"
