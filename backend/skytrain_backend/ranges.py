"""The ranges every number and text a client sends must lie in, stated once.

Request schemas use these types, so the OpenAPI document states each range and a value
outside it is refused (400, naming the field and the range) before any work is done. The
limits come from where the value ends up:

- steps are ``integer`` columns: 32-bit on PostgreSQL, so at most 2^31 - 1 on every database
  (SQLite's 64-bit integers would take more, and the two must agree);
- event ids (the events' cursor) are ``bigint``: at most 2^63 - 1;
- seeds go to ``torch.Generator.manual_seed`` (64 bits) and Python's ``random``: a signed
  64-bit integer, as vLLM accepts;
- metric values and rewards are JSON numbers summed as floats: finite floats, and integers
  of at most 64 bits, even where a float is taken (a reward): an integer is stored exactly
  or refused, never rounded to a float (2^70 would be 1.1805916207174113e21);
- text never holds NUL: PostgreSQL cannot store it in a text column or in JSONB;
- the names of new models (entity, project, name) are ASCII letters, digits, ``_``, ``-`` and
  ``.``, starting with a letter, digit or ``_``: no ``.`` or ``..``, no control, invisible or
  right-to-left characters that make one name look like another;
- integers and booleans are strict where a typo would become a value: ``true`` is not 1,
  ``"3"`` is not 3 and ``1.0`` is not 1 (``StrictInt``; pydantic's ``StrictBool``);
- sampling options are in OpenAI's documented ranges (``temperature`` 0 to 2, ``top_p`` above
  0 to 1, penalties -2 to 2).

No torch and no database here: the API, the engines and the trainer all import it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, Strict, StringConstraints

from skytrain_backend.errors import InvalidRequest
from skytrain_backend.json_types import JSONObject

INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

MAX_STEP = INT32_MAX
MAX_EVENT_ID = INT64_MAX
MIN_SEED, MAX_SEED = INT64_MIN, INT64_MAX

# Text that may reach SQL: any character but NUL (and, for names, no control character).
NO_NUL_PATTERN = r"^[^\x00]*$"
# Ids skytrain issues are 32 hex digits; cursors and path ids are checked for this shape.
ID_PATTERN = r"^[0-9A-Za-z_-]+$"
ID_MAX_LENGTH = 64
# Entity, project and model names end up in "<entity>/<project>/<name>:step<N>" references.
NAME_PATTERN = r"^[^/:\s\x00-\x1f\x7f]+$"
# What a new model's entity, project and name may be (NAME_PATTERN still finds older ones).
SAFE_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
NAME_MAX_LENGTH = 128
SPLIT_PATTERN = r"^[A-Za-z0-9._-]+$"
# Event ids as cursors: at most 18 digits, well inside the bigint column.
EVENT_ID_PATTERN = r"^[0-9]{1,18}$"
# The longest a long-poll (a worker's lease, a client following a job's events) is held.
MAX_WAIT_S = 30.0

# OpenAI's ranges for the sampling options (vLLM's where OpenAI has none).
MAX_TEMPERATURE = 2.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0

StrictInt = Annotated[int, Strict()]
Step = Annotated[
    int, Strict(), Field(ge=0, le=MAX_STEP, description="A checkpoint step (0 to 2^31-1).")
]
Seed = Annotated[
    int, Strict(), Field(ge=MIN_SEED, le=MAX_SEED, description="A 64-bit signed seed.")
]


def _safe_name(value: str) -> str:
    if not re.fullmatch(SAFE_NAME_PATTERN, value):
        raise ValueError(
            "a name is ASCII letters, digits, '_', '-' and '.', starting with a letter, a digit "
            f"or '_' (at most {NAME_MAX_LENGTH} characters): {value[:40]!r} is not"
        )
    return value


SafeName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=NAME_MAX_LENGTH, strip_whitespace=True),
    AfterValidator(_safe_name),
    Field(json_schema_extra={"pattern": SAFE_NAME_PATTERN}),
]
"""A new model's entity, project or name."""


def _int64_if_integer(value: Any) -> Any:
    """Refuse an integer outside 64 bits, whatever type it is about to become."""
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            "integers must fit in 64 bits (-2^63 to 2^63 - 1): write a larger number as a "
            "float (1.5e21)"
        )
    return value


# A metric: a finite float, or an integer of at most 64 bits (bools are integers too).
MetricInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
MetricFloat = Annotated[float, Field(allow_inf_nan=False)]
MetricValue = Annotated[MetricFloat | MetricInt | bool, BeforeValidator(_int64_if_integer)]
# A reward: a finite float, which an integer of at most 64 bits may be written as.
Reward = Annotated[float, BeforeValidator(_int64_if_integer), Field(allow_inf_nan=False)]

Text = Annotated[str, StringConstraints(pattern=NO_NUL_PATTERN)]

# Free-form JSON a client stores (metadata, tags): nested at most this deep.
MAX_JSON_DEPTH = 16


def _storable(value: Any, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` can be stored as JSONB and read back as sent."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("text must not contain NUL (\\u0000)")
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("integers must fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, depth + 1)
            _storable(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _storable(item, depth + 1)


def _storable_json(value: JSONObject) -> JSONObject:
    _storable(value)
    return value


JsonObject = Annotated[JSONObject, AfterValidator(_storable_json)]
"""A JSON object with no NUL in any text, finite numbers, 64-bit integers, at most 16 deep."""


def parse_step(digits: str, *, where: str) -> int:
    """The step written as ``digits``; InvalidRequest naming ``where`` if it is out of range."""
    if digits.isascii() and digits.isdigit() and len(digits) <= 10 and int(digits) <= MAX_STEP:
        return int(digits)
    raise InvalidRequest(f"{where}: step {digits[:20]} is out of range: steps are 0 to {MAX_STEP}")
