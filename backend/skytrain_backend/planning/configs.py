"""Where a base model's ``config.json`` is found: on this machine, or from the Hub alone.

A directory named by a path holds its own; a Hugging Face id's is in skytrain's model cache
(``$SKYTRAIN_HOME/models``, the converted copies) or in the Hugging Face cache (a machine
that downloaded the model once, ``HF_HOME``): ``find_model_config``, which downloads nothing.

``fetch_hub_config`` downloads that one file (never the weights) from the Hub the operator
names (``HF_ENDPOINT``), with the operator's ``HF_TOKEN``: a fresh control plane plans with
it before any launch. What keeps the file from it (a gated or private repository, a wrong
id, the Hub out of reach) is a ``ModelConfigUnavailable`` naming the base model and what to
do, and never the Hub's address.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from skytrain_backend.base_models import is_hub_id
from skytrain_backend.errors import ModelConfigUnavailable
from skytrain_backend.json_types import JSONObject

CONFIG_FILE = "config.json"
# A config.json is a few kilobytes; a file far larger is not one.
MAX_CONFIG_BYTES = 1024 * 1024


def read_config(path: Path) -> JSONObject | None:
    """The JSON object in ``path``, or None if it is missing, too large or not an object."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def find_model_config(base_model: str, *, cache_dir: Path) -> JSONObject | None:
    """``base_model``'s config.json from this machine's copies, or None."""
    if not is_hub_id(base_model):
        return read_config(Path(base_model).expanduser() / CONFIG_FILE)
    cached = read_config(cache_dir / base_model.replace("/", "--") / CONFIG_FILE)
    if cached is not None:
        return cached
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(base_model, CONFIG_FILE)
    return read_config(Path(found)) if isinstance(found, str) else None


def fetch_hub_config(
    base_model: str, *, endpoint: str | None, token: str | None, timeout_s: float
) -> JSONObject:
    """``base_model``'s config.json downloaded alone from the Hub at ``endpoint`` (None: the
    public Hub), with ``token`` (None: none, even if this machine has one saved); read into
    memory, never into a cache the workers or other tenants read, and never more than
    ``MAX_CONFIG_BYTES`` of it nor for longer than about ``timeout_s``: any tenant may name a
    repository, and its "config.json" may be gigabytes sent slowly.

    Raises ModelConfigUnavailable when the Hub refuses it (gated or private: 401/403), has
    no such repository or file (404), cannot be reached in ``timeout_s``, or sends
    something that is not a JSON object of at most ``MAX_CONFIG_BYTES``.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(base_model, CONFIG_FILE, endpoint=endpoint)
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    cut_short = False
    try:
        with get_session().stream(
            "GET",
            url,
            headers=build_hf_headers(token=token or False),
            timeout=timeout_s,
            follow_redirects=True,
        ) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_CONFIG_BYTES or time.monotonic() > deadline:
                    cut_short = True
                    break
    except Exception as exc:
        raise ModelConfigUnavailable(_why_unavailable(base_model, exc)) from None
    if cut_short and len(data) <= MAX_CONFIG_BYTES:  # cut by the deadline
        raise ModelConfigUnavailable(_why_unavailable(base_model, TimeoutError()))
    try:
        config = json.loads(data) if len(data) <= MAX_CONFIG_BYTES else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ModelConfigUnavailable(
            f"the Hugging Face Hub's {CONFIG_FILE} for base model {base_model} is not a JSON "
            "object of at most 1 MiB: check the model id"
        )
    return config


def _why_unavailable(base_model: str, exc: BaseException) -> str:
    """What kept ``base_model``'s config.json away, in words a tenant and an operator can act
    on: huggingface_hub's own messages carry the Hub's URL, so none of them is passed on."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, HfHubHTTPError):
        cause = cause.__cause__ or cause.__context__
    status = cause.response.status_code if isinstance(cause, HfHubHTTPError) else None
    if isinstance(cause, GatedRepoError) or status == 403:
        return (
            f"base model {base_model} is gated on the Hugging Face Hub, and the control plane "
            f"may not read its {CONFIG_FILE}: the operator sets HF_TOKEN (SKYTRAIN_HF_TOKEN) to "
            "a token of an account that accepted the model's terms, or choose another base model"
        )
    if isinstance(cause, RemoteEntryNotFoundError | RevisionNotFoundError):
        return (
            f"base model {base_model} has no {CONFIG_FILE} on the Hugging Face Hub: check the "
            "model id (a transformers model's repository, such as Qwen/Qwen2.5-7B-Instruct)"
        )
    if isinstance(cause, RepositoryNotFoundError) or status in (401, 404):
        return (
            f"base model {base_model} is not on the Hugging Face Hub, or is private: check the "
            "model id; for a private or gated model the operator sets HF_TOKEN "
            "(SKYTRAIN_HF_TOKEN) to a token that may read it"
        )
    return (
        f"the Hugging Face Hub could not be reached for base model {base_model}'s "
        f"{CONFIG_FILE} (offline, or no answer in time): it is asked again later; if this "
        "lasts, the operator checks the network and HF_ENDPOINT"
    )
