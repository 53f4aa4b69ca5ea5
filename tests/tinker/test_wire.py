"""The Tinker SDK's protobuf messages: what the official SDK writes, skytrain reads; what
skytrain writes, the SDK's own readers read. No server: the SDK's converters make the bytes."""

from __future__ import annotations

import math

import pytest
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import tinker_protobuf
from tinker import types


def _tensor(values: list[float] | list[int], dtype: str) -> types.TensorData:
    return types.TensorData(data=values, dtype=dtype)  # type: ignore[arg-type]


def _body(
    data: list[types.Datum],
    loss_fn: str = "cross_entropy",
    config: dict[str, float | str] | None = None,
    *,
    forward_only: bool = False,
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data,
            loss_fn=loss_fn,  # type: ignore[arg-type]
            loss_fn_config=config,
        ),
        model_id="run:train:0",
        seq_id=4,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return bytes(message.SerializeToString())


def _rl_datum(n: int = 3, **overrides: types.TensorData) -> types.Datum:
    inputs = {
        "target_tokens": _tensor(list(range(2, n + 2)), "int64"),
        "logprobs": _tensor([-1.0] * n, "float32"),
        "advantages": _tensor([0.5] * n, "float32"),
        **overrides,
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, n + 1))), loss_fn_inputs=inputs
    )


def test_the_sdks_forward_backward_request_decodes_with_all_its_inputs() -> None:
    datum = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[5, 6]),
                types.EncodedTextChunk(tokens=[7]),
            ]
        ),
        loss_fn_inputs={
            "target_tokens": _tensor([6, 7, 8], "int64"),
            "weights": _tensor([0.0, 1.0, 0.5], "float32"),
        },
    )
    batch = tinker_protobuf.parse_forward_backward(_body([datum], forward_only=True), max_tokens=16)
    assert (batch.model_id, batch.seq_id, batch.loss_fn) == ("run:train:0", 4, "cross_entropy")
    assert batch.forward_only and batch.num_tokens == 3
    assert batch.data[0].tokens == [5, 6, 7]
    assert batch.data[0].inputs["target_tokens"].values() == [6, 7, 8]
    assert batch.data[0].inputs["weights"].values() == [0.0, 1.0, 0.5]


def test_loss_config_is_read_and_completed_with_defaults() -> None:
    batch = tinker_protobuf.parse_forward_backward(
        _body([_rl_datum()], "ppo", {"clip_low_threshold": 0.5}), max_tokens=16
    )
    assert batch.loss_config == {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2}
    dro = tinker_protobuf.parse_forward_backward(
        _body([_rl_datum()], "dro", {"beta": 0.1}), max_tokens=16
    )
    assert dro.loss_config == {"beta": pytest.approx(0.1)}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (lambda: b"\xff\xff\xff", "not a forward_backward protobuf message"),
        (lambda: _body([_rl_datum()], "gspo"), "'gspo' is not served by skytrain"),
        (lambda: _body([_rl_datum()], "stable_reinforce"), "not served by skytrain"),
        (lambda: _body([_rl_datum()], "warp_drive"), "unknown loss_fn 'warp_drive'"),
        (lambda: _body([_rl_datum()], "dro"), "needs loss_fn_config={'beta'"),
        (lambda: _body([_rl_datum()], "ppo", {"temperature": 1.0}), "do not apply to 'ppo'"),
        (
            lambda: _body([_rl_datum(advantages=_tensor([1.0, math.nan, 1.0], "float32"))], "ppo"),
            "NaN or infinite",
        ),
        (
            lambda: _body([_rl_datum(logprobs=_tensor([-1.0, -1.0], "float32"))], "ppo"),
            "needs one value per model input token: [3]",
        ),
        (
            lambda: _body([_rl_datum(mask=_tensor([1.0, 1.0, 1.0], "float32"))], "ppo"),
            "has ['mask'], which this loss does not take",
        ),
        (
            lambda: _body(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": _tensor([1.5, 2.5], "float32")},
                    )
                ]
            ),
            "must hold integer ids",
        ),
        (
            lambda: _body(
                [
                    types.Datum(
                        model_input=types.ModelInput(
                            chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]
                        ),
                        loss_fn_inputs={"target_tokens": _tensor([1], "int64")},
                    )
                ]
            ),
            "chunk 0 is image: skytrain trains on token chunks only",
        ),
        (lambda: _body([_rl_datum(n=40)], "ppo"), "more than the model's max_seq_length (16)"),
    ],
    ids=[
        "not-protobuf",
        "gspo",
        "stable-reinforce",
        "unknown-loss",
        "dro-without-beta",
        "unknown-config",
        "nan",
        "wrong-length",
        "extra-input",
        "float-targets",
        "image-chunk",
        "too-long",
    ],
)
def test_requests_skytrain_cannot_run_are_refused_naming_the_problem(
    body: object, message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        tinker_protobuf.parse_forward_backward(body(), max_tokens=16)  # type: ignore[operator]
    assert message in caught.value.message


def test_forward_backward_outputs_decode_with_the_sdks_reader() -> None:
    body = tinker_protobuf.encode_forward_backward_output(
        [[-0.5, -1.5, -2.5], [-1.0]], {"loss:sum": 5.5}
    )
    output = deserialize_forward_backward_output(body)
    assert output.loss_fn_output_type == "ArrayRecord"
    assert [out["logprobs"].tolist() for out in output.loss_fn_outputs] == [
        [-0.5, -1.5, -2.5],
        [-1.0],
    ]
    assert output.metrics == {"loss:sum": 5.5}


def test_sample_responses_decode_with_the_sdks_reader() -> None:
    body = tinker_protobuf.encode_sample_response(
        [
            tinker_protobuf.SampledSequence([5, 6, 7], [-0.25, -0.5, -0.75], "length"),
            tinker_protobuf.SampledSequence([9, 2], [-1.0, -2.0], "stop"),
        ]
    )
    response = deserialize_sample_response(body)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([5, 6, 7], [-0.25, -0.5, -0.75], "length"),
        ([9, 2], [-1.0, -2.0], "stop"),
    ]
