"""Every number and text a client sends has a range: outside it, a 400 naming the field and the
range, before any work, on both databases, and nothing stored.

Each test reproduces a request that used to end in a 500 (or be stored) on at least one
database: steps past the step column, cursors of odd digits, a 401-digit metric, NaN and
Infinity, NUL in names, ids and query strings, unbounded SFT options.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.api.support import group, sft_trajectory, trajectory
from tests.fixtures.callers import Caller

INT32_MAX = 2**31 - 1
TOO_LARGE_STEPS = [2**31, 2**63, 10**30]


@pytest.fixture
def model_id(caller: Caller) -> str:
    model_id = caller.create_model()["id"]
    # Something stored already, so "unchanged" means more than "still empty".
    logged = caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    assert logged.status_code == 201, logged.text
    return model_id


def _refused(
    caller: Caller,
    stored: Callable[[Caller], Any],
    send: Callable[[], httpx.Response],
    *fragments: str,
    status: int = 400,
) -> str:
    before = stored(caller)
    response = send()
    assert response.status_code == status, response.text
    message = str(response.json()["error"]["message"])
    for fragment in fragments:
        assert fragment in message, message
    assert stored(caller) == before
    return message


def _post_json(caller: Caller, url: str, text: str) -> httpx.Response:
    """A body as raw JSON text (NaN, Infinity and huge numbers as some clients write them)."""
    return caller.http.post(url, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize("step", TOO_LARGE_STEPS)
def test_steps_past_the_step_column_are_refused_naming_the_range(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str, step: int
) -> None:
    http = caller.http
    inference_name = caller.http.get(f"/v1/models/{model_id}").json()["inference_name"]
    for send in (
        lambda: http.get(f"/v1/models/{model_id}/checkpoints/{step}"),
        lambda: http.get(f"/v1/models/{model_id}/checkpoints/{step}/files"),
        lambda: http.get(f"/v1/models/{model_id}/checkpoints/{step}/files/adapter_config.json"),
        lambda: http.get(f"/v1/models/{model_id}/logs", params={"step": step}),
        lambda: http.request(
            "DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [1, step]}
        ),
        lambda: http.post(
            f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()], "step": step}
        ),
        lambda: http.post(
            "/v1/chat/completions",
            json={
                "model": f"{inference_name}:step{step}",
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        lambda: http.post(
            "/v1/completions", json={"model": f"{model_id}:step{step}", "prompt": "hi"}
        ),
    ):
        _refused(caller, stored, send, str(INT32_MAX))


@pytest.mark.parametrize("after", ["²", "١٢", "9" * 30, "-1", "1e3", "0x10"])
def test_event_cursors_that_are_not_event_ids_are_refused(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str, after: str
) -> None:
    job = caller.http.post(
        "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
    )
    assert job.status_code == 201, job.text
    url = f"/v1/training-jobs/{job.json()['id']}/events"
    assert caller.http.get(url, params={"after": "0"}).status_code == 200
    _refused(
        caller,
        stored,
        lambda: caller.http.get(url, params={"after": after}),
        "query parameter after",
    )


def test_a_401_digit_metric_is_refused_naming_it(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str
) -> None:
    body = json.dumps({"trajectory_groups": [group(1.0, 0.0, score=1.0)]}).replace(
        '"score": 1.0', '"score": 1' + "0" * 400, 1
    )
    _refused(
        caller,
        stored,
        lambda: _post_json(caller, f"/v1/models/{model_id}/log", body),
        "trajectory_groups[0].trajectories[0].metrics.score",
    )


def _with_number(where: str, number: str) -> str:
    """A batch (JSON text) whose reward, trajectory metric or group metric is ``number``."""
    groups = [group(1.0, 0.0) if where == "group metric" else group(1.0, 0.0, score=0.5)]
    if where == "group metric":
        groups[0]["metrics"] = {"score": 0.5}
    text = json.dumps({"trajectory_groups": groups})
    if where == "reward":
        return text.replace('"reward": 1.0', f'"reward": {number}', 1)
    return text.replace('"score": 0.5', f'"score": {number}', 1)


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ("reward", "trajectory_groups[0].trajectories[0].reward"),
        ("trajectory metric", "trajectory_groups[0].trajectories[0].metrics.score"),
        ("group metric", "trajectory_groups[0].metrics.score"),
    ],
)
@pytest.mark.parametrize("number", [str(2**70), str(2**63), str(-(2**63) - 1)])
def test_an_integer_past_64_bits_in_a_reward_or_metric_is_refused_naming_it(
    caller: Caller,
    stored: Callable[[Caller], Any],
    model_id: str,
    where: str,
    path: str,
    number: str,
) -> None:
    """Integers are taken exactly or not at all: 2^70 used to be stored as 1.18e21."""
    text = _with_number(where, number)
    job = text.replace("{", f'{{"model_id": "{model_id}", ', 1)
    for send in (
        lambda: _post_json(caller, f"/v1/models/{model_id}/log", text),
        lambda: _post_json(caller, "/v1/training-jobs", job),
    ):
        _refused(caller, stored, send, path, "64 bits")


def test_a_metric_of_64_bits_is_stored_exactly_and_one_written_as_a_float_as_a_float(
    caller: Caller, model_id: str
) -> None:
    sent = {
        "trajectory metric": str(-(2**63)),
        "group metric": "1.1805916207174113e21",
    }
    stored = {}
    for where, number in sent.items():
        logged = _post_json(caller, f"/v1/models/{model_id}/log", _with_number(where, number))
        assert logged.status_code == 201, logged.text
        batch = caller.http.get(f"/v1/models/{model_id}/logs/{logged.json()['id']}").json()
        stored[where] = batch["trajectory_groups"][0]
    assert stored["trajectory metric"]["trajectories"][0]["metrics"]["score"] == -(2**63)
    assert stored["group metric"]["metrics"]["score"] == 1.1805916207174113e21


def test_nan_and_infinity_in_a_training_config_are_refused_naming_the_field(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str
) -> None:
    groups = json.dumps([group()])
    for config, field in (
        ('"experimental_config": {"epsilon": Infinity}', "experimental_config.epsilon"),
        ('"config": {"max_grad_norm": NaN}', "config.max_grad_norm"),
        ('"config": {"epsilon": -Infinity}', "config.epsilon"),
        # Parses as a float, but an infinite one.
        ('"config": {"kl_penalty_coef": 1e999}', "config.kl_penalty_coef"),
    ):
        body = f'{{"model_id": "{model_id}", "trajectory_groups": {groups}, {config}}}'
        _refused(
            caller,
            stored,
            lambda body=body: _post_json(caller, "/v1/training-jobs", body),
            field,
            "finite",
        )


def test_nan_temperature_is_refused_by_the_gateway(caller: Caller, model_id: str) -> None:
    name = caller.http.get(f"/v1/models/{model_id}").json()["inference_name"]
    body = (
        f'{{"model": "{name}", "messages": [{{"role": "user", "content": "hi"}}], '
        '"temperature": NaN}'
    )
    response = _post_json(caller, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert "temperature: Input should be a finite number" in response.json()["error"]["message"]
    # NaN anywhere else in the body is refused too: it is not JSON and could not be forwarded.
    body = f'{{"model": "{name}", "prompt": "hi", "x_extra": [1, NaN]}}'
    response = _post_json(caller, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert "NaN, which is not a JSON number" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("seed", 2**64, "seed"),
        ("n", 10**6, "n"),
        ("max_tokens", 2**63, "max_tokens"),
        ("top_k", 2**70, "top_k"),
    ],
)
def test_sampling_integers_out_of_range_are_refused_by_the_gateway(
    caller: Caller, model_id: str, field: str, value: int, named: str
) -> None:
    name = caller.http.get(f"/v1/models/{model_id}").json()["inference_name"]
    response = caller.http.post(
        "/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": "hi"}], field: value},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(f"{named}: Input should be")


NUL = "\x00"


def test_nul_in_names_ids_and_query_strings_is_refused(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str
) -> None:
    http = caller.http
    model = {"project": "p", "name": "n", "base_model": "tiny/llama"}
    for body, field in (
        ({**model, "name": f"a{NUL}b"}, "name"),
        ({**model, "project": f"{NUL}"}, "project"),
        ({**model, "entity": f"e{NUL}"}, "entity"),
        ({**model, "base_model": f"tiny/{NUL}llama"}, "base_model"),
        ({**model, "config": {"lora_target_modules": [f"q_proj{NUL}"]}}, "lora_target_modules"),
    ):
        _refused(caller, stored, lambda body=body: http.post("/v1/models", json=body), field)
    for url, params, field in (
        ("/v1/models", {"project": f"p{NUL}"}, "query parameter project"),
        ("/v1/models", {"after": f"x{NUL}"}, "query parameter after"),
        ("/v1/training-jobs", {"model_id": f"{model_id}{NUL}"}, "query parameter model_id"),
        (f"/v1/models/{model_id}/logs", {"split": f"val{NUL}"}, "query parameter split"),
        (f"/v1/models/{model_id}/checkpoints", {"after": NUL}, "query parameter after"),
    ):
        _refused(caller, stored, lambda url=url, params=params: http.get(url, params=params), field)
    for url in (f"/v1/models/{model_id}%00", "/v1/training-jobs/x%00y"):
        _refused(caller, stored, lambda url=url: http.get(url), "path parameter")
    metric = {"trajectory_groups": [{"trajectories": [trajectory(**{f"a{NUL}b": 1.0})]}]}
    _refused(
        caller,
        stored,
        lambda: http.post(f"/v1/models/{model_id}/log", json=metric),
        "trajectory_groups[0].trajectories[0].metrics",
    )
    chat = {"model": f"{caller.key.tenant_name}/p/n{NUL}", "prompt": "hi"}
    _refused(caller, stored, lambda: http.post("/v1/completions", json=chat), "model")


def test_sft_epochs_and_learning_rate_lists_are_bounded(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str
) -> None:
    trajectories = [sft_trajectory()]
    for config, fragments in (
        ({"num_epochs": 1_000_000_000}, ("config.num_epochs", "less than or equal to 100")),
        ({"learning_rate": [1e-5] * 10_001}, ("config.learning_rate", "at most 10000 items")),
        ({"seed": 2**64}, ("config.seed", "less than or equal to")),
    ):
        _refused(
            caller,
            stored,
            lambda config=config: caller.http.post(
                "/v1/sft-training-jobs",
                json={"model_id": model_id, "trajectories": trajectories, "config": config},
            ),
            *fragments,
        )


@pytest.mark.parametrize("bad", [".", "..", "\u202egnp.exe", "a\u200bb", "-rf", "caf\u00e9"])
def test_names_outside_the_safe_characters_are_refused_naming_the_field(
    caller: Caller, stored: Callable[[Caller], Any], bad: str
) -> None:
    """`.`, `..` and U+202E (right-to-left override) were accepted as entity, project or
    model names, so one model's name could be made to look like another's."""
    for field in ("entity", "project", "name"):
        body = {"project": "tests", "name": "agent", "base_model": "tiny/llama", field: bad}
        _refused(
            caller,
            stored,
            lambda body=body: caller.http.post("/v1/models", json=body),  # type: ignore[misc]
            field,
            "ASCII letters, digits",
        )


_OPTIONS = [
    ("max_tokens", True, "max_tokens: Input should be a valid integer"),
    ("max_tokens", 4.0, "max_tokens: Input should be a valid integer"),
    ("n", True, "n: Input should be a valid integer"),
    ("seed", "7", "seed: Input should be a valid integer"),
    ("temperature", 1e308, "temperature: Input should be less than or equal to 2"),
    ("temperature", True, "temperature: Input should be a valid number"),
    ("top_p", 1.5, "top_p: Input should be less than or equal to 1"),
    ("presence_penalty", 3, "presence_penalty: Input should be less than or equal to 2"),
    ("frequency_penalty", -2.5, "frequency_penalty: Input should be greater than or equal"),
    ("ignore_eos", 1, "ignore_eos: Input should be a valid boolean"),
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("option", "value", "fragment"), _OPTIONS)
def test_inference_options_are_strict_and_in_openais_ranges(
    caller: Caller,
    stored: Callable[[Caller], Any],
    model_id: str,
    route: str,
    option: str,
    value: Any,
    fragment: str,
) -> None:
    """`"max_tokens": true` read as 1 and a temperature of 1e308 went to the engine."""
    body: dict[str, Any] = {"model": model_id, option: value}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    _refused(caller, stored, lambda: caller.http.post(route, json=body), fragment)


def test_chat_logprobs_must_be_a_boolean(
    caller: Caller, stored: Callable[[Caller], Any], model_id: str
) -> None:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}
    _refused(
        caller,
        stored,
        lambda: caller.http.post("/v1/chat/completions", json=body),
        "logprobs: Input should be a valid boolean",
    )


def test_return_existing_must_be_a_boolean(caller: Caller, stored: Callable[[Caller], Any]) -> None:
    body = {"project": "tests", "name": "agent", "base_model": "tiny/llama", "return_existing": 1}
    _refused(
        caller,
        stored,
        lambda: caller.http.post("/v1/models", json=body),
        "return_existing: Input should be a valid boolean",
    )
