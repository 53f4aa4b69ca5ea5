"""The one name for JSON whose shape belongs to someone else, not to skytrain.

``JSONObject`` is for values skytrain stores or hands on without reading a shape of its own
into them: a user's metadata, a model's ``config.json``, a SkyPilot task file, an OpenAPI
document, a tool's JSON schema. Where skytrain knows the shape, the type says it instead (a
pydantic model, a TypedDict, ``dict[str, float]`` for metrics).
"""

from typing import Any

JSONObject = dict[str, Any]
"""A JSON object of arbitrary shape (decoded: str keys, JSON values)."""
