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


def checkpoint_prefix(
    *, tenant_id: str, model_id: str, step: int, writer: str | None = None
) -> str:
    """Where a step's files lie: ``checkpoints/{step}-{writer}/`` for a checkpoint committed
    by ``writer`` (a job's attempt: nobody else ever writes there, so an attempt that lost
    its lease mid-copy cannot write over the step another attempt committed), and
    ``checkpoints/{step}/`` for checkpoints committed before writers had their own."""
    directory = str(step) if writer is None else f"{step}-{writer}"
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}checkpoints/{directory}/"


def checkpoint_key(*, tenant_id: str, model_id: str, step: int, file: str) -> str:
    return checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step) + file


def attempt_writer(*, job_id: str, attempt: int) -> str:
    """The ``writer`` of ``checkpoint_prefix`` for an attempt of a job."""
    return f"{job_id}.{attempt}"


def committed_prefix(*, tenant_id: str, model_id: str, uri: str) -> str:
    """The prefix of a committed checkpoint's files, from the ``uri`` its row records (the
    store's URL may have changed since: only the directory, its last segment, is used)."""
    directory = checkpoint_directory(uri)
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}checkpoints/{directory}/"


def checkpoint_directory(uri: str) -> str:
    """The directory under ``checkpoints/`` a committed checkpoint's ``uri`` names."""
    return uri.rstrip("/").rpartition("/")[2]


def checkpoint_step(directory: str) -> int | None:
    """The step a directory under ``checkpoints/`` holds (``3`` or ``3-{writer}``), or None."""
    step = directory.partition("-")[0]
    return int(step) if step.isdigit() else None


def job_input_key(*, tenant_id: str, model_id: str, job_id: str) -> str:
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}jobs/{job_id}/input.jsonl"


def log_key(*, tenant_id: str, model_id: str, batch_id: str) -> str:
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}logs/{batch_id}.jsonl"


def files_prefix(tenant_id: str) -> str:
    """Where the tenant's uploaded files lie."""
    return f"{tenant_prefix(tenant_id)}files/"


def file_key(*, tenant_id: str, file_id: str) -> str:
    return f"{files_prefix(tenant_id)}{file_id}.jsonl"


def tinker_op_key(*, tenant_id: str, model_id: str, seq_id: int, name: str) -> str:
    """A Tinker operation's input or output (``input.pb``, ``output.pb``)."""
    return f"{model_prefix(tenant_id=tenant_id, model_id=model_id)}tinker/ops/{seq_id}/{name}"


HUB_CONFIGS_PREFIX = "hub/configs/"


def hub_config_key(*, endpoint: str, base_model: str) -> str:
    """Where the control plane keeps a base model's config.json read from the Hub at
    ``endpoint``: named by a digest, so neither the id nor the Hub's address is in the key."""
    digest = hashlib.sha256(f"{endpoint}\n{base_model}".encode()).hexdigest()
    return f"{HUB_CONFIGS_PREFIX}{digest}.json"
