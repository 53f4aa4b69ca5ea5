"""Which base models a tenant may name: Hugging Face ids, and directories the operator allows.

A base model is what a worker loads, so its name is checked before a model is registered:

- a Hugging Face model id (``Qwen/Qwen2.5-0.5B-Instruct``, ``gpt2``) of the shape the Hub
  itself accepts: one or two names of letters, digits, ``_``, ``-`` and ``.``, at most 96
  characters, no ``--`` or ``..``. An id is never read as a directory, even if one of that
  name exists where a worker runs;
- an absolute path inside one of the directories in ``SKYTRAIN_BASE_MODEL_DIRS`` (default:
  the model cache, ``$SKYTRAIN_HOME/models``), symbolic links resolved: ``/etc`` or another
  directory of the host cannot be named.

Messages say what to send instead and never show the allowed directories (host paths) to a
tenant. No torch and no database: the API checks names with it, and ``hub`` reads ids with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from skytrain_backend.errors import InvalidRequest

HUB_ID_MAX_LENGTH = 96
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID_RE = re.compile(rf"^(?:{_NAME}/)?{_NAME}$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hugging Face model id."""
    return (
        len(name) <= HUB_ID_MAX_LENGTH
        and _HUB_ID_RE.match(name) is not None
        and "--" not in name
        and ".." not in name
    )


def check_base_model(name: str, *, allowed_dirs: Sequence[Path]) -> str:
    """``name`` if a tenant may use it as a base model; InvalidRequest saying why not."""
    if is_hub_id(name):
        return name
    if name.startswith("/") and "\x00" not in name:
        resolved = Path(os.path.realpath(name))
        for directory in allowed_dirs:
            root = Path(os.path.realpath(directory))
            if resolved != root and resolved.is_relative_to(root):
                return name
        raise InvalidRequest(
            f"base_model {name!r} is a path this control plane does not load models from: "
            "name a Hugging Face model id ('Qwen/Qwen2.5-0.5B-Instruct'), or ask the operator "
            "for a directory of base models (SKYTRAIN_BASE_MODEL_DIRS)"
        )
    raise InvalidRequest(
        f"base_model {name!r} is not a Hugging Face model id: use 'organization/name' "
        f"('Qwen/Qwen2.5-0.5B-Instruct'): letters, digits, '_', '-' and '.', at most "
        f"{HUB_ID_MAX_LENGTH} characters, no '--' or '..'"
    )
