"""msgspec Structs derived from ``protocol``'s trajectory models: how the API reads a batch quickly.

The pydantic models in ``protocol`` (``TrajectoryGroup``, ``Trajectory``...) define what a
trajectory is: the OpenAPI document shows them, the worker reads stored batches with them, and
their error messages are what a client sees. Validating hundreds of thousands of small objects
with them is slow, so ``api.ingest`` first decodes each group (or SFT trajectory) into these
Structs, in msgspec's C decoder; only an item msgspec refuses is validated again by pydantic,
which either names the problem as it always has, or accepts it (pydantic is laxer: ``"1.5"``
for a float).

Nothing here restates the models. At import, each Struct is made from its model's fields
(``model_fields``, in order): their types, their defaults, their constraints (lengths, bounds,
patterns), and then checked by the model's own validators (``field_validator``s and
``model_validator``s, mode "after": they read the same attributes on a Struct). A field or
validator the derivation cannot mirror exactly stops the import, so a change to the models
either carries over or fails at once. What the derivation adds are msgspec's limits:

- a union told apart by a function (``protocol.MessageOrChoice``) becomes one Struct with
  the fields of each member, all optional; ``__post_init__`` asks the model's own
  discriminator which member an item is, drops the other's fields (UNSET is never encoded)
  and fills in the member's defaults, so the Struct encodes as the model would;
- pydantic's JSON parser refuses values nested 200 deep, msgspec's goes deeper: free-form
  fields (``dict[str, Any]``...) nested past ``MAX_FREE_FORM_DEPTH`` are left to pydantic;
- a float field that refuses integers past 64 bits (``ranges.Reward``) reads integers as
  integers, within 64 bits, then holds the float the model makes of them;
- ``_METHODS``: what ``api.ingest`` calls on a Struct where the model's method would build
  model objects (``Trajectory.histories``).

The rule is one-sided, and ``tests/api/test_trajectory_structs.py`` holds the two to it:
whatever these Structs accept, pydantic accepts too, as the same values, and
``msgspec.json.encode`` of a Struct writes the JSON ``model_dump_json`` writes: the same
fields in the same order, defaults filled in, unknown fields dropped (byte for byte but for
how a few floats are spelled: ``1e+16`` there, ``1e16`` here).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired, Union, cast

import annotated_types
import msgspec
import pydantic
from msgspec import UNSET, Meta, UnsetType
from pydantic._internal._fields import PydanticMetadata
from pydantic.fields import FieldInfo
from pydantic.functional_validators import BeforeValidator
from typing_extensions import is_typeddict

from skytrain_backend import protocol
from skytrain_backend.protocol import (
    TOKEN_ID_PREFIX,
    SampledTurn,
    names_token_ids,
    token_id_digits,
)
from skytrain_backend.ranges import INT64_MAX, INT64_MIN, _int64_if_integer

# pydantic's JSON parser refuses values nested 200 deep, counted from the group; msgspec's
# goes deeper. Free-form fields (metadata, tools, content parts: at most ten levels into a
# group) nested deeper than this are left to pydantic to judge.
MAX_FREE_FORM_DEPTH = 64

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]


class _Derived(msgspec.Struct, kw_only=True):
    """A Struct made from a model; unknown fields are ignored, as ``protocol``'s models do."""

    if TYPE_CHECKING:
        # The fields are made at import, so the type checker knows none of them.
        def __getattr__(self, name: str) -> Any: ...


def _too_deep(value: object, depth: int = 1) -> bool:
    """Whether ``value`` (a container ``depth`` levels deep) nests past the limit."""
    if depth > MAX_FREE_FORM_DEPTH:
        return True
    if isinstance(value, dict):
        return any(
            _too_deep(item, depth + 1) for item in value.values() if isinstance(item, dict | list)
        )
    if isinstance(value, list):
        return any(_too_deep(item, depth + 1) for item in value if isinstance(item, dict | list))
    return False


# --- types ------------------------------------------------------------------------------------


class _Field(typing.NamedTuple):
    """A field's Struct type and what ``__post_init__`` does with it."""

    type: Any
    free_form: bool  # holds ``Any``: checked for depth
    to_float: bool  # an integer read within 64 bits, held as the float the model makes


def _flat_metadata(metadata: list[Any]) -> list[Any]:
    flat: list[Any] = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            flat += _flat_metadata(item.metadata)
        elif isinstance(item, annotated_types.GroupedMetadata):
            flat += _flat_metadata(list(item))
        else:
            flat.append(item)
    return flat


_BOUNDS = {
    annotated_types.MinLen: "min_length",
    annotated_types.MaxLen: "max_length",
    annotated_types.Ge: "ge",
    annotated_types.Le: "le",
    annotated_types.Gt: "gt",
    annotated_types.Lt: "lt",
}


def _constrained(tp: Any, metadata: list[Any], where: str) -> _Field:
    """``tp`` with pydantic's ``metadata`` as msgspec ``Meta``."""
    meta: dict[str, Any] = {}
    int64 = False
    for item in _flat_metadata(metadata):
        if type(item) in _BOUNDS:
            name = _BOUNDS[type(item)]
            meta[name] = getattr(item, name)
        elif isinstance(item, pydantic.AllowInfNan | pydantic.Tag):
            pass  # msgspec's floats are finite; a tag is read by the union
        elif isinstance(item, BeforeValidator) and item.func is _int64_if_integer:
            int64 = True
        elif isinstance(item, PydanticMetadata) and _only_pattern(vars(item)):
            meta["pattern"] = vars(item)["pattern"]
        else:
            raise TypeError(f"{where}: {item!r} has no msgspec equivalent here")
    field = _struct_type(tp, where)
    result = Annotated[field.type, Meta(**meta)] if meta else field.type
    if int64 and tp is float:
        return _Field(result | Int64, field.free_form, to_float=True)
    if int64 and not _bounded_int(field.type):
        raise TypeError(f"{where}: integers past 64 bits refused where nothing bounds them")
    return _Field(result, field.free_form, field.to_float)


def _only_pattern(settings: Mapping[str, object]) -> bool:
    """Whether pydantic's string settings say no more than a pattern (none strips or
    changes the text)."""
    return settings.get("pattern") is not None and not any(
        value is not None for name, value in settings.items() if name != "pattern"
    )


def _bounded_int(tp: Any) -> bool:
    """Whether every integer ``tp`` reads is held to 64 bits already: it has no integer
    member, or one bounded as ``Int64``."""
    members = typing.get_args(tp) if _is_union(tp) else (tp,)
    return Int64 in members or all(
        typing.get_origin(m) is not Annotated and m is not int for m in members
    )


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _struct_type(tp: Any, where: str) -> _Field:
    """The msgspec type that reads what pydantic's ``tp`` reads (or less)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, *metadata = args
        if any(isinstance(item, pydantic.Discriminator) for item in metadata):
            return _Field(_union_struct(tp, where), free_form=False, to_float=False)
        return _constrained(base, metadata, where)
    if tp is Any:
        return _Field(Any, free_form=True, to_float=False)
    if tp in (str, int, float, bool, type(None)) or origin is Literal:
        return _Field(tp, free_form=False, to_float=False)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        return _Field(derive(tp), free_form=False, to_float=False)
    if is_typeddict(tp):
        return _Field(_typeddict_struct(tp), free_form=False, to_float=False)
    if origin in (list, dict) or _is_union(tp):
        parts = [_struct_type(arg, where) for arg in args]
        if any(part.to_float for part in parts):
            raise TypeError(f"{where}: a float read from integers only as a field of its own")
        made: Any
        if origin is list:
            made = types.GenericAlias(list, (parts[0].type,))
        elif origin is dict:
            made = types.GenericAlias(dict, (parts[0].type, parts[1].type))
        else:
            made = Union[tuple(part.type for part in parts)]  # noqa: UP007
        return _Field(made, any(part.free_form for part in parts), to_float=False)
    raise TypeError(f"{where}: {tp!r} has no msgspec equivalent here")


# --- Structs ----------------------------------------------------------------------------------

# What a Struct does besides holding its model's fields: the methods ``api.ingest`` and the
# trainability rule call, where the model's own would build model objects.
_METHODS: dict[type[pydantic.BaseModel], dict[str, object]] = {
    protocol.Trajectory: {
        "histories": lambda self: [self, *self.additional_histories],
    },
}

_made: dict[Any, type[_Derived]] = {}


def _defstruct(
    name: str, fields: Any, namespace: dict[str, object] | None = None
) -> type[_Derived]:
    return cast(
        type[_Derived],
        msgspec.defstruct(
            name, fields, bases=(_Derived,), kw_only=True, namespace=namespace, module=__name__
        ),
    )


def _after_validators(
    model: type[pydantic.BaseModel],
) -> tuple[list[tuple[str, Callable[[Any], Any]]], list[Callable[[Any], Any]]]:
    """The model's field validators (field, function) and model validators, mode "after"."""
    decorators = model.__pydantic_decorators__
    if (
        decorators.validators
        or decorators.root_validators
        or decorators.field_serializers
        or decorators.model_serializers
        or decorators.computed_fields
    ):
        raise TypeError(f"{model.__name__}: decorators msgspec cannot mirror")
    fields: list[tuple[str, Callable[[Any], Any]]] = []
    for field_validator in decorators.field_validators.values():
        if field_validator.info.mode != "after":
            raise TypeError(
                f"{model.__name__}: a field validator of mode {field_validator.info.mode}"
            )
        fields += [(name, field_validator.func) for name in field_validator.info.fields]
    models: list[Callable[[Any], Any]] = []
    for model_validator in decorators.model_validators.values():
        if model_validator.info.mode != "after":
            raise TypeError(
                f"{model.__name__}: a model validator of mode {model_validator.info.mode}"
            )
        models.append(model_validator.func)
    return fields, models


class _Spec(typing.NamedTuple):
    """One field of a model, as a Struct holds it."""

    field: _Field
    info: FieldInfo

    @property
    def required(self) -> bool:
        return self.info.is_required()

    def struct_field(self, name: str) -> tuple[str, Any] | tuple[str, Any, Any]:
        if self.required:
            return (name, self.field.type)
        if self.info.default_factory is not None:
            factory = self.info.default_factory
            return (name, self.field.type, msgspec.field(default_factory=factory))  # type: ignore[arg-type]
        return (name, self.field.type, self.info.default)


def _specs(model: type[pydantic.BaseModel]) -> dict[str, _Spec]:
    """Each field of ``model``, in order."""
    config = model.model_config
    if config.get("extra", "ignore") != "ignore" or config.get("strict"):
        raise TypeError(f"{model.__name__}: only models that ignore unknown fields, lax")
    return {
        name: _Spec(_constrained(info.annotation, info.metadata, f"{model.__name__}.{name}"), info)
        for name, info in model.model_fields.items()
    }


class _Code:
    """The source of a ``__post_init__``, and the names it uses.

    It is written out, attribute by attribute, and compiled once at import (as ``dataclasses``
    writes ``__init__``): a loop over field names with ``getattr`` cost a third more decoding
    time than the attribute reads here.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, object] = {"UNSET": UNSET, "_too_deep": _too_deep}

    def name(self, value: Any) -> str:
        """A name the code calls ``value`` by."""
        key = f"_v{len(self.names)}"
        self.names[key] = value
        return key

    def add(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    def checks(self, model: type[pydantic.BaseModel], specs: dict[str, _Spec], indent: int) -> None:
        """What ``model``'s fields need on a Struct: a float read from an integer made one,
        free-form values judged for depth, then the model's own validators."""
        for name, spec in specs.items():
            if spec.field.to_float:
                self.add(indent, f"self.{name} = float(self.{name})")
        for name, spec in specs.items():
            if spec.field.free_form:
                self.add(
                    indent, f"if type(self.{name}) in (dict, list) and _too_deep(self.{name}):"
                )
                self.add(indent + 1, "raise ValueError('nested too deep to judge here')")
        field_validators, model_validators = _after_validators(model)
        for name, validator in field_validators:
            self.add(indent, f"{self.name(validator)}(self.{name})")
        for validator in model_validators:
            self.add(indent, f"{self.name(validator)}(self)")

    def function(self, name: str) -> Callable[[Any], None] | None:
        """The function, or None when it would do nothing."""
        if not self.lines:
            return None
        source = f"def {name}(self):\n" + "\n".join(self.lines) + "\n"
        exec(compile(source, f"<derived {name}>", "exec"), self.names)
        return cast(Callable[[Any], None], self.names[name])


def derive(model: type[pydantic.BaseModel]) -> type[_Derived]:
    """The Struct that reads what ``model`` reads (or refuses it) and encodes as it dumps."""
    if model in _made:
        return _made[model]
    specs = _specs(model)
    namespace: dict[str, object] = {
        "__doc__": f"``protocol.{model.__name__}`` as a Struct.",
        **_METHODS.get(model, {}),
    }
    code = _Code()
    code.checks(model, specs, indent=1)
    if (post_init := code.function("__post_init__")) is not None:
        namespace["__post_init__"] = post_init
    struct = _defstruct(
        model.__name__,
        [spec.struct_field(name) for name, spec in specs.items()],
        namespace,
    )
    _made[model] = struct
    return struct


def _typeddict_struct(tp: Any) -> type[_Derived]:
    """A TypedDict as a Struct: a key it may leave out is left out (UNSET) when it was."""
    if tp in _made:
        return _made[tp]
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, hint in typing.get_type_hints(tp, include_extras=True).items():
        where = f"{tp.__name__}.{name}"
        if typing.get_origin(hint) is NotRequired:
            field = _struct_type(typing.get_args(hint)[0], where)
            fields.append((name, field.type | UnsetType, UNSET))
        else:
            field = _struct_type(hint, where)
            fields.append((name, field.type))
        if field.free_form or field.to_float:
            raise TypeError(f"{where}: only plain fields in a TypedDict")
    struct = _defstruct(tp.__name__, fields)
    _made[tp] = struct
    return struct


_IMMUTABLE = (type(None), bool, int, float, str, tuple)


def _is_given(name: str) -> property:
    """Whether the Struct's field ``name`` was given (or filled in). Compiled as a plain
    attribute read: the trainability rule asks it of every turn."""
    code = _Code()
    code.add(1, f"return self.{name} is not UNSET")
    return property(code.function(f"is_given_{name}"))


class _Given(dict[str, object]):
    """The fields given to a Struct, as a discriminator function reads a dict: only ``in``."""

    __slots__ = ("_struct",)
    _struct: Any

    def __contains__(self, key: object) -> bool:
        return getattr(self._struct, str(key), UNSET) is not UNSET


def _union_struct(tp: Any, where: str) -> type[_Derived]:
    """A union told apart by a function, as one Struct holding every member's fields.

    ``__post_init__`` asks the union's discriminator which member the item is, drops the
    other members' fields, fills in the member's defaults and checks it as the member's
    Struct would. ``is_<tag>`` says which member it is (its first required field is set).
    """
    if tp in _made:
        return _made[tp]
    union, *metadata = typing.get_args(tp)
    (discriminator,) = [item for item in metadata if isinstance(item, pydantic.Discriminator)]
    if not callable(discriminator.discriminator):
        raise TypeError(f"{where}: only a union told apart by a function")
    members: dict[str, tuple[type[pydantic.BaseModel], dict[str, _Spec]]] = {}
    for member in typing.get_args(union):
        model, *tags = typing.get_args(member)
        (tag,) = [item.tag for item in tags if isinstance(item, pydantic.Tag)]
        members[tag] = (model, _specs(model))
    names = [name for _, specs in members.values() for name in specs]
    if len(set(names)) != len(names):
        raise TypeError(f"{where}: members of the union share field names")

    code = _Code()
    code.add(1, f"given = {code.name(_Given)}()")
    code.add(1, "given._struct = self")
    code.add(1, f"tag = {code.name(discriminator.discriminator)}(given)")
    namespace: dict[str, object] = {
        "__doc__": f"One of {', '.join(members)}, told apart as the model tells them.",
    }
    for number, (tag, (model, specs)) in enumerate(members.items()):
        code.add(1, f"{'el' if number else ''}if tag == {tag!r}:")
        for name in names:
            if name not in specs:
                code.add(2, f"self.{name} = UNSET")
        for name, spec in specs.items():
            code.add(2, f"if self.{name} is UNSET:")
            if spec.required:
                code.add(3, f"raise ValueError('{name} is missing')")
            elif spec.info.default_factory is not None:
                code.add(3, f"self.{name} = {code.name(spec.info.default_factory)}()")
            elif isinstance(spec.info.default, _IMMUTABLE):
                code.add(3, f"self.{name} = {code.name(spec.info.default)}")
            else:
                raise TypeError(f"{where}: {tag}.{name} has a mutable default")
        code.checks(model, specs, indent=2)
        first_required = next(name for name, spec in specs.items() if spec.required)
        namespace[f"is_{tag}"] = _is_given(first_required)
    code.add(1, "else:")
    code.add(2, "raise ValueError(f'not one of the union: {tag}')")
    namespace["__post_init__"] = code.function("__post_init__")
    struct = _defstruct(
        "Turn",
        [
            (name, spec.field.type | UnsetType, UNSET)
            for _, specs in members.values()
            for name, spec in specs.items()
        ],
        namespace,
    )
    _made[tp] = struct
    return struct


if TYPE_CHECKING:
    TrajectoryGroup = _Derived
    Trajectory = _Derived
    Turn = _Derived
    ChoiceLogprobs = _Derived
else:
    TrajectoryGroup = derive(protocol.TrajectoryGroup)
    Trajectory = derive(protocol.Trajectory)
    Turn = _struct_type(protocol.MessageOrChoice, "MessageOrChoice").type
    ChoiceLogprobs = derive(protocol.ChoiceLogprobs)

GROUP_DECODER = msgspec.json.Decoder(TrajectoryGroup)
TRAJECTORY_DECODER = msgspec.json.Decoder(Trajectory)


def sampled_turn(item: Turn, allow_training_without_logprobs: bool) -> SampledTurn | None:
    """``protocol.sampled_turn`` on a Struct: the same reading of a choice."""
    if not item.is_choice:
        return None
    token_ids = item.token_ids if isinstance(item.token_ids, list) else None
    logprobs = item.logprobs
    content = logprobs.content if isinstance(logprobs, ChoiceLogprobs) else None
    if not content:
        return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
    tokens = [entry.token for entry in content]
    listed_ids: list[int] | None = None  # only compared with token_ids: read only then
    if not token_ids:
        if not names_token_ids(tokens):
            return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
    elif _names_exactly(tokens, token_ids):
        listed_ids = token_ids
    else:
        digits = token_id_digits(tokens)
        if digits is None:
            return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
        listed_ids = list(map(int, digits))
    return SampledTurn(
        listed_ids=listed_ids,
        token_ids=token_ids,
        logprobs=None if allow_training_without_logprobs else _DECODED_FLOATS,
    )


# The logprobs of a choice the Structs read need no check but being there: every float msgspec
# decodes is finite (it refuses NaN, Infinity and numbers out of range), so the rule is given
# none of the values to check (reading 64 of them per choice cost more than the rest of it).
_DECODED_FLOATS: list[float] = []


_TOKEN_ID_SEPARATOR = "," + TOKEN_ID_PREFIX
_encode = msgspec.json.Encoder().encode


def _names_exactly(tokens: list[str], token_ids: list[int]) -> bool:
    """Whether ``tokens`` are ``token_id:<id>`` of each of ``token_ids`` in turn, written as
    skytrain's endpoint writes them: what ``token_id_digits`` would find, proved with one
    string comparison. A token holding a comma adds one to the joined tokens, which then
    cannot equal ids joined by exactly ``len(token_ids) - 1`` commas."""
    if len(tokens) != len(token_ids):
        return False
    # The ids as msgspec writes them, "[1,2,3]": the same digits as str() gives each int, made
    # in C (str() of every id took most of the reading of a choice).
    listed = _encode(token_ids)[1:-1].decode("ascii").replace(",", _TOKEN_ID_SEPARATOR)
    return ",".join(tokens) == TOKEN_ID_PREFIX + listed


def count_trainable_turns(
    group: TrajectoryGroup, g: int, *, allow_training_without_logprobs: bool = False
) -> int:
    """``protocol.count_trainable_turns`` on the Structs: the same rules and messages."""
    return protocol.count_trainable_turns(
        group,
        g,
        allow_training_without_logprobs=allow_training_without_logprobs,
        sampled=sampled_turn,
    )


def has_assistant_turn(trajectory: Trajectory) -> bool:
    """Whether an SFT trajectory has a turn to learn from (a choice or an assistant message)."""
    return any(
        item.is_choice or item.role == "assistant" for item in trajectory.messages_and_choices
    )
