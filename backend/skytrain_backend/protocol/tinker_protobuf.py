"""The binary part of the Tinker SDK's wire format, and the loss functions' inputs.

The official ``tinker`` SDK sends ``forward_backward`` (and ``forward``) requests as protobuf
(``Content-Type: application/x-protobuf``) and asks for ``ForwardBackwardOutput`` and
``SampleResponse`` results as protobuf too; every other call is JSON. The messages below are
the subset of the SDK's ``tinker_public`` schema skytrain reads and writes, with the same field
numbers (that is all the wire format depends on), built at import time: no generated code and
no ``protoc``. Fields skytrain does not declare (image chunks' contents, provenance spans) are
skipped by the parser; their presence is still visible where it matters and refused clearly.

Token ids and tensors travel as little-endian packed arrays (``np.ndarray.tobytes()`` on the
SDK's side); they are read here with ``memoryview`` casts, so the control plane needs neither
numpy nor torch.

``LOSS_INPUTS`` says which ``loss_fn_inputs`` and ``loss_fn_config`` keys each loss takes: the
control plane validates requests against it before storing them, and the trainer runs them.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from skytrain_backend.errors import InvalidRequest

PROTOBUF_MEDIA_TYPE = "application/x-protobuf"

# --- the schema -----------------------------------------------------------------------------

_PACKAGE = "skytrain.tinker_wire"
_FieldProto = descriptor_pb2.FieldDescriptorProto
_Field = Any  # a FieldDescriptorProto (its stubs give it no usable class type)

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1


def _field(
    name: str,
    number: int,
    kind: int,
    *,
    repeated: bool = False,
    type_name: str | None = None,
    oneof: int | None = None,
) -> _Field:
    proto = _FieldProto(
        name=name,
        number=number,
        type=kind,
        label=_FieldProto.LABEL_REPEATED if repeated else _FieldProto.LABEL_OPTIONAL,
    )
    if type_name is not None:
        proto.type_name = f".{_PACKAGE}.{type_name}"
    if oneof is not None:
        proto.oneof_index = oneof
    return proto


def _message(
    name: str,
    fields: Sequence[_Field],
    *,
    oneofs: Sequence[str] = (),
    maps: Sequence[tuple[str, int, int, str | None]] = (),
) -> descriptor_pb2.DescriptorProto:
    """A message; ``maps`` are ``(field name, number, value kind, value message)``."""
    proto = descriptor_pb2.DescriptorProto(name=name)
    proto.field.extend(fields)
    for oneof in oneofs:
        proto.oneof_decl.add(name=oneof)
    for map_name, number, value_kind, value_type in maps:
        entry_name = "".join(part.title() for part in map_name.split("_")) + "Entry"
        entry = proto.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        entry.field.extend(
            [
                _field("key", 1, _FieldProto.TYPE_STRING),
                _field("value", 2, value_kind, type_name=value_type),
            ]
        )
        proto.field.append(
            _field(
                map_name,
                number,
                _FieldProto.TYPE_MESSAGE,
                repeated=True,
                type_name=f"{name}.{entry_name}",
            )
        )
    return proto


def _schema() -> descriptor_pb2.FileDescriptorProto:
    F = _FieldProto
    schema = descriptor_pb2.FileDescriptorProto(
        name="skytrain/tinker_wire.proto", package=_PACKAGE, syntax="proto3"
    )
    dtype = schema.enum_type.add(name="DType")
    for value_name, number in (("UNSPECIFIED", 0), ("FLOAT32", 1), ("INT64", 2), ("INT32", 3)):
        dtype.value.add(name=f"DTYPE_{value_name}", number=number)
    stop = schema.enum_type.add(name="StopReason")
    stop.value.add(name="STOP_REASON_STOP", number=STOP_REASON_STOP)
    stop.value.add(name="STOP_REASON_LENGTH", number=STOP_REASON_LENGTH)
    schema.message_type.extend(
        [
            _message(
                "SparseCsr",
                [
                    _field("values", 1, F.TYPE_BYTES),
                    _field("crow_indices", 2, F.TYPE_BYTES),
                    _field("col_indices", 3, F.TYPE_BYTES),
                ],
            ),
            _message(
                "Tensor",
                [
                    _field("dense", 1, F.TYPE_BYTES, oneof=0),
                    _field("sparse_csr", 2, F.TYPE_MESSAGE, type_name="SparseCsr", oneof=0),
                    _field("dtype", 3, F.TYPE_ENUM, type_name="DType"),
                    _field("shape", 4, F.TYPE_INT64, repeated=True),
                ],
                oneofs=["encoding"],
            ),
            _message("EncodedTextChunk", [_field("tokens", 1, F.TYPE_BYTES)]),
            # Image and audio chunks: declared so their presence is seen; contents skipped.
            _message("ImageChunk", []),
            _message("DmelChunk", []),
            _message(
                "Chunk",
                [
                    _field(
                        "encoded_text", 1, F.TYPE_MESSAGE, type_name="EncodedTextChunk", oneof=0
                    ),
                    _field("image", 2, F.TYPE_MESSAGE, type_name="ImageChunk", oneof=0),
                    _field("dmel", 3, F.TYPE_MESSAGE, type_name="DmelChunk", oneof=0),
                ],
                oneofs=["chunk"],
            ),
            _message("ProvenanceSpan", []),
            _message(
                "Datum",
                [
                    _field("model_input", 1, F.TYPE_MESSAGE, repeated=True, type_name="Chunk"),
                    _field(
                        "model_input_spans",
                        3,
                        F.TYPE_MESSAGE,
                        repeated=True,
                        type_name="ProvenanceSpan",
                    ),
                    _field(
                        "loss_fn_input_spans",
                        4,
                        F.TYPE_MESSAGE,
                        repeated=True,
                        type_name="ProvenanceSpan",
                    ),
                ],
                maps=[("loss_fn_inputs", 2, F.TYPE_MESSAGE, "Tensor")],
            ),
            _message(
                "LossConfigValue",
                [
                    _field("number", 1, F.TYPE_DOUBLE, oneof=0),
                    _field("text", 2, F.TYPE_STRING, oneof=0),
                ],
                oneofs=["value"],
            ),
            _message(
                "ForwardBackwardRequest",
                [
                    _field("model_id", 1, F.TYPE_STRING),
                    _field("seq_id", 2, F.TYPE_INT32),
                    _field("data", 3, F.TYPE_MESSAGE, repeated=True, type_name="Datum"),
                    _field("loss_fn", 4, F.TYPE_STRING),
                    _field("forward_only", 6, F.TYPE_BOOL),
                ],
                maps=[
                    ("loss_fn_config", 5, F.TYPE_DOUBLE, None),
                    ("loss_fn_config_v2", 7, F.TYPE_MESSAGE, "LossConfigValue"),
                ],
            ),
            _message(
                "BatchedTensor",
                [
                    _field("data", 1, F.TYPE_BYTES),
                    _field("offsets", 2, F.TYPE_BYTES),
                    _field("dtype", 3, F.TYPE_ENUM, type_name="DType"),
                    _field("trailing_shape", 4, F.TYPE_INT64, repeated=True),
                ],
            ),
            _message(
                "ArrayRecord",
                [_field("type_tag", 1, F.TYPE_STRING), _field("num_datums", 3, F.TYPE_INT64)],
                maps=[("fields", 2, F.TYPE_MESSAGE, "BatchedTensor")],
            ),
            _message(
                "ForwardBackwardOutput",
                [
                    _field("loss_fn_output_type", 1, F.TYPE_STRING),
                    _field(
                        "loss_fn_outputs", 2, F.TYPE_MESSAGE, repeated=True, type_name="ArrayRecord"
                    ),
                ],
                maps=[("metrics", 3, F.TYPE_DOUBLE, None)],
            ),
            _message(
                "TopkLogprobs",
                [
                    _field("token_ids", 1, F.TYPE_BYTES),
                    _field("logprobs", 2, F.TYPE_BYTES),
                    _field("k", 3, F.TYPE_UINT32),
                    _field("length", 4, F.TYPE_UINT32),
                ],
            ),
            _message(
                "SampledSequence",
                [
                    _field("stop_reason", 1, F.TYPE_ENUM, type_name="StopReason"),
                    _field("tokens", 2, F.TYPE_BYTES),
                    _field("logprobs", 3, F.TYPE_BYTES),
                    _field("topk_sampled_logprobs", 4, F.TYPE_MESSAGE, type_name="TopkLogprobs"),
                ],
            ),
            _message(
                "SampleResponse",
                [
                    _field(
                        "sequences", 1, F.TYPE_MESSAGE, repeated=True, type_name="SampledSequence"
                    ),
                    _field("prompt_logprobs", 2, F.TYPE_BYTES),
                    _field("topk_prompt_logprobs", 3, F.TYPE_MESSAGE, type_name="TopkLogprobs"),
                    _field("prompt_cache_hit_tokens", 4, F.TYPE_INT32),
                ],
            ),
        ]
    )
    return schema


_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.Add(_schema())


def _message_class(name: str) -> type[Message]:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


ForwardBackwardRequestMessage = _message_class("ForwardBackwardRequest")
ForwardBackwardOutputMessage = _message_class("ForwardBackwardOutput")
SampleResponseMessage = _message_class("SampleResponse")


# --- the losses ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """The per-token tensors a loss reads (each one value per model-input token) and the
    ``loss_fn_config`` keys it accepts, with their defaults (None: required)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)


_POLICY_GRADIENT = ("target_tokens", "logprobs", "advantages")
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSS_INPUTS: dict[str, LossInputs] = {
    "cross_entropy": LossInputs(required=("target_tokens",), optional=("weights",)),
    "importance_sampling": LossInputs(required=_POLICY_GRADIENT),
    "ppo": LossInputs(required=_POLICY_GRADIENT, config=dict(_CLIP)),
    "cispo": LossInputs(required=_POLICY_GRADIENT, config=dict(_CLIP)),
    "dro": LossInputs(required=_POLICY_GRADIENT, config={"beta": None}),
}
# Losses the SDK names that skytrain's trainer does not run, and why.
UNSUPPORTED_LOSSES = {
    "gspo": "its sequence-level ratio is not implemented",
    "stable_reinforce": "it needs the sampler's recorded stability information",
    "custom": "server-side custom losses are not stored; forward_backward_custom with a "
    "Python callable works (the SDK computes the loss itself)",
}
_INTEGER_INPUTS = frozenset({"target_tokens"})


def loss_config(loss_fn: str, given: dict[str, float | str]) -> dict[str, float]:
    """``loss_fn_config`` checked against the loss and completed with its defaults."""
    spec = loss_spec(loss_fn)
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        accepted = ", ".join(sorted(spec.config)) or "none"
        raise InvalidRequest(
            f"loss_fn_config key(s) {unknown} do not apply to {loss_fn!r} (accepted: {accepted})"
        )
    config: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise InvalidRequest(f"{loss_fn!r} needs loss_fn_config={{{key!r}: <number>}}")
        if isinstance(value, str) or not math.isfinite(value):
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}")
        config[key] = float(value)
    return config


def loss_spec(loss_fn: str) -> LossInputs:
    if loss_fn in LOSS_INPUTS:
        return LOSS_INPUTS[loss_fn]
    if loss_fn in UNSUPPORTED_LOSSES:
        raise InvalidRequest(
            f"loss_fn {loss_fn!r} is not served by skytrain ({UNSUPPORTED_LOSSES[loss_fn]}): "
            f"use one of {sorted(LOSS_INPUTS)}"
        )
    raise InvalidRequest(f"unknown loss_fn {loss_fn!r}: use one of {sorted(LOSS_INPUTS)}")


# --- decoded requests ---------------------------------------------------------------------------

TensorDtype = Literal["float32", "int64", "int32"]
_DTYPES: dict[int, tuple[TensorDtype, str]] = {
    DTYPE_FLOAT32: ("float32", "f"),
    DTYPE_INT64: ("int64", "q"),
    DTYPE_INT32: ("int32", "i"),
}


@dataclass(frozen=True)
class WireTensor:
    """A dense tensor as sent: its dtype, shape and packed little-endian bytes."""

    dtype: TensorDtype
    shape: tuple[int, ...]
    data: bytes

    def values(self) -> list[Any]:
        code = {"float32": "f", "int64": "q", "int32": "i"}[self.dtype]
        return _unpack(self.data, code)


@dataclass(frozen=True)
class WireDatum:
    tokens: list[int]
    inputs: dict[str, WireTensor]


@dataclass(frozen=True)
class ForwardBackwardBatch:
    """A decoded, validated ``forward_backward`` (or ``forward``) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool
    data: list[WireDatum]

    @property
    def num_tokens(self) -> int:
        return sum(len(datum.tokens) for datum in self.data)


def _unpack(data: bytes, code: str) -> list[Any]:
    items = array(code)
    items.frombytes(data)
    if sys.byteorder != "little":
        items.byteswap()
    return items.tolist()


def _pack(values: Sequence[float] | Sequence[int], code: str) -> bytes:
    items = array(code, values)
    if sys.byteorder != "little":
        items.byteswap()
    return items.tobytes()


def _tensor(message: Any, *, where: str) -> WireTensor:
    if message.dtype not in _DTYPES:
        raise InvalidRequest(
            f"{where} has an unknown dtype ({message.dtype}): send float32 or int64"
        )
    if message.WhichOneof("encoding") == "sparse_csr":
        raise InvalidRequest(
            f"{where} is a sparse tensor; skytrain takes dense 1-D tensors here (one value per "
            "model input token)"
        )
    dtype, code = _DTYPES[message.dtype]
    itemsize = array(code).itemsize
    if len(message.dense) % itemsize:
        raise InvalidRequest(f"{where} has {len(message.dense)} bytes, not a whole {dtype} array")
    count = len(message.dense) // itemsize
    shape = tuple(int(n) for n in message.shape) or (count,)
    if math.prod(shape) != count:
        raise InvalidRequest(f"{where} has shape {list(shape)} but {count} values")
    return WireTensor(dtype=dtype, shape=shape, data=bytes(message.dense))


def _datum(message: Any, index: int, *, spec: LossInputs, max_tokens: int) -> WireDatum:
    where = f"data[{index}]"
    if len(message.model_input_spans) or len(message.loss_fn_input_spans):
        raise InvalidRequest(f"{where} has provenance spans: no loss served by skytrain uses them")
    tokens: list[int] = []
    for position, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequest(
                f"{where}.model_input chunk {position} is {kind or 'empty'}: skytrain trains on "
                "token chunks only (ModelInput.from_ints)"
            )
        if len(chunk.encoded_text.tokens) % 4:
            raise InvalidRequest(f"{where}.model_input chunk {position} is not an int32 array")
        tokens += _unpack(chunk.encoded_text.tokens, "i")
    if not tokens:
        raise InvalidRequest(f"{where}.model_input has no tokens")
    if len(tokens) > max_tokens:
        raise InvalidRequest(
            f"{where}.model_input has {len(tokens)} tokens, more than the model's "
            f"max_seq_length ({max_tokens})"
        )
    if min(tokens) < 0:
        raise InvalidRequest(f"{where}.model_input has a negative token id")
    given = set(message.loss_fn_inputs)
    missing = [name for name in spec.required if name not in given]
    if missing:
        raise InvalidRequest(f"{where}.loss_fn_inputs lacks {missing}")
    unknown = sorted(given - set(spec.required) - set(spec.optional))
    if unknown:
        accepted = sorted(spec.required + spec.optional)
        raise InvalidRequest(
            f"{where}.loss_fn_inputs has {unknown}, which this loss does not take "
            f"(accepted: {accepted})"
        )
    inputs = {}
    for name in sorted(given):
        tensor = _tensor(message.loss_fn_inputs[name], where=f"{where}.loss_fn_inputs[{name!r}]")
        if tensor.shape != (len(tokens),):
            raise InvalidRequest(
                f"{where}.loss_fn_inputs[{name!r}] has shape {list(tensor.shape)}; it needs one "
                f"value per model input token: [{len(tokens)}]"
            )
        values = tensor.values()
        if name in _INTEGER_INPUTS:
            if tensor.dtype == "float32":
                raise InvalidRequest(f"{where}.loss_fn_inputs[{name!r}] must hold integer ids")
            if min(values) < 0:
                raise InvalidRequest(f"{where}.loss_fn_inputs[{name!r}] has a negative token id")
        elif not all(math.isfinite(value) for value in values):
            raise InvalidRequest(f"{where}.loss_fn_inputs[{name!r}] has a NaN or infinite value")
        inputs[name] = tensor
    return WireDatum(tokens=tokens, inputs=inputs)


def decode_forward_backward(body: bytes) -> Any:
    """The protobuf ``ForwardBackwardRequest`` in ``body`` (``InvalidRequest`` if it is not one)."""
    message: Any = ForwardBackwardRequestMessage()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise InvalidRequest(
            "the body is not a forward_backward protobuf message: send it with the tinker SDK"
        ) from None
    return message


def validate_forward_backward(message: Any, *, max_tokens: int) -> ForwardBackwardBatch:
    """A decoded request checked in full: ``InvalidRequest`` names the first problem (datum,
    input and what is expected). ``max_tokens`` is the longest datum the model takes."""
    spec = loss_spec(message.loss_fn)
    given: dict[str, float | str] = {key: value for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        given[key] = value.text if value.WhichOneof("value") == "text" else value.number
    config = loss_config(message.loss_fn, given)
    if not message.data:
        raise InvalidRequest("data is empty: send at least one Datum")
    data = [
        _datum(datum, index, spec=spec, max_tokens=max_tokens)
        for index, datum in enumerate(message.data)
    ]
    return ForwardBackwardBatch(
        model_id=message.model_id,
        seq_id=int(message.seq_id),
        loss_fn=message.loss_fn,
        loss_config=config,
        forward_only=bool(message.forward_only),
        data=data,
    )


def parse_forward_backward(body: bytes, *, max_tokens: int) -> ForwardBackwardBatch:
    return validate_forward_backward(decode_forward_backward(body), max_tokens=max_tokens)


# --- encoded results ----------------------------------------------------------------------------


def encode_forward_backward_output(
    logprobs: Sequence[Sequence[float]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput``: each datum's target-token logprobs, and the metrics.

    The SDK reads every metric name as ``<name>:<reduction>`` (``loss:sum``).
    """
    message: Any = ForwardBackwardOutputMessage()
    message.loss_fn_output_type = "ArrayRecord"
    record = message.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    batched = record.fields["logprobs"]
    batched.dtype = DTYPE_FLOAT32
    offsets = [0]
    chunks = []
    for values in logprobs:
        chunk = _pack(values, "f")
        chunks.append(chunk)
        offsets.append(offsets[-1] + len(chunk))
    batched.data = b"".join(chunks)
    batched.offsets = _pack(offsets, "q")
    for key, value in metrics.items():
        message.metrics[key] = value
    return bytes(message.SerializeToString())


# A position's most likely (token id, logprob) pairs; None where nothing was scored.
TopLogprobs = list[tuple[int, float]] | None
# What the SDK reads as an empty top-k row (``tinker.types.topk_logprobs.MASK_LOGPROB``).
TOPK_MASK_LOGPROB = -99999.0


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    # Per sampled token, its position's k most likely tokens (``topk_sample_logprobs``).
    topk: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class PromptScores:
    """``include_prompt_logprobs``' answer: each prompt token's logprob (None for the first
    token and for those not asked for), and each position's top k when they were asked for."""

    logprobs: list[float | None]
    topk: list[TopLogprobs] | None = None


def _encode_topk(message: Any, rows: Sequence[TopLogprobs], k: int) -> None:
    """Rows of up to ``k`` pairs as the SDK's dense ``(length, k)`` matrices, a missing pair
    filled with (0, ``TOPK_MASK_LOGPROB``)."""
    ids: list[int] = []
    values: list[float] = []
    for row in rows:
        pairs = list(row or [])[:k]
        pairs += [(0, TOPK_MASK_LOGPROB)] * (k - len(pairs))
        ids += [token for token, _ in pairs]
        values += [value for _, value in pairs]
    message.token_ids = _pack(ids, "i")
    message.logprobs = _pack(values, "f")
    message.k = k
    message.length = len(rows)


def _width(rows: Sequence[TopLogprobs]) -> int:
    return max((len(row) for row in rows if row), default=0)


def encode_sample_response(
    sequences: Sequence[SampledSequence], prompt: PromptScores | None = None
) -> bytes:
    message: Any = SampleResponseMessage()
    for sequence in sequences:
        item = message.sequences.add()
        item.stop_reason = STOP_REASON_LENGTH if sequence.stop_reason == "length" else 0
        item.tokens = _pack(sequence.tokens, "i")
        item.logprobs = _pack(sequence.logprobs, "f")
        if sequence.topk is not None and _width(sequence.topk):
            _encode_topk(item.topk_sampled_logprobs, sequence.topk, _width(sequence.topk))
    if prompt is not None:
        message.prompt_logprobs = _pack(
            [math.nan if value is None else value for value in prompt.logprobs], "f"
        )
        if prompt.topk is not None and _width(prompt.topk):
            _encode_topk(message.topk_prompt_logprobs, prompt.topk, _width(prompt.topk))
    return bytes(message.SerializeToString())
