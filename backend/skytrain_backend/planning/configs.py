"""Where a base model's ``config.json`` is found without downloading anything.

A directory named by a path holds its own; a Hugging Face id's is in skytrain's model cache
(``$SKYTRAIN_HOME/models``, the converted copies) or in the Hugging Face cache (a machine
that downloaded the model once, ``HF_HOME``). Anything else is unknown to this machine: the
control plane then lets the worker, which downloads the model, decide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skytrain_backend.base_models import is_hub_id

CONFIG_FILE = "config.json"
# A config.json is a few kilobytes; a file far larger is not one.
MAX_CONFIG_BYTES = 1024 * 1024


def read_config(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if it is missing, too large or not an object."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def find_model_config(base_model: str, *, cache_dir: Path) -> dict[str, Any] | None:
    """``base_model``'s config.json from this machine's copies, or None."""
    if not is_hub_id(base_model):
        return read_config(Path(base_model).expanduser() / CONFIG_FILE)
    cached = read_config(cache_dir / base_model.replace("/", "--") / CONFIG_FILE)
    if cached is not None:
        return cached
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(base_model, CONFIG_FILE)
    return read_config(Path(found)) if isinstance(found, str) else None
