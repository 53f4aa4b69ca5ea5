"""Malformed requests get a 4xx naming the problem, and nothing is stored.

Each test takes a snapshot of the tenant's rows and objects before the request and checks
it is identical afterwards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.storage import ObjectStore
from tests.api.support import add_checkpoint, group, trajectory
from tests.fixtures.callers import Caller


@pytest.fixture
def model_id(caller: Caller) -> str:
    model_id = caller.create_model()["id"]
    # Something stored already, so "unchanged" means more than "still empty".
    caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    return model_id


Refused = Callable[..., None]


def _post_raw(caller: Caller, url: str, content: bytes | str | Iterator[bytes]) -> httpx.Response:
    """POST ``content`` as it is, labelled JSON."""
    return caller.http.post(url, content=content, headers={"content-type": "application/json"})


@pytest.fixture
def refused(caller: Caller, stored: Callable[[Caller], Any]) -> Refused:
    """``refused(send, status, *fragments)``: ``send()`` answers ``status`` with a message
    holding each fragment, and the caller's rows and objects are as they were before."""

    def check(send: Callable[[], Any], status: int, *fragments: str) -> None:
        before = stored(caller)
        response = send()
        assert response.status_code == status, response.text
        message = response.json()["error"]["message"]
        for fragment in fragments:
            assert fragment in message
        assert stored(caller) == before

    return check


@pytest.mark.parametrize("route", ["log", "training-jobs"])
def test_bad_json_is_refused(caller: Caller, refused: Refused, model_id: str, route: str) -> None:
    url = f"/v1/models/{model_id}/log" if route == "log" else "/v1/training-jobs"
    refused(
        lambda: _post_raw(caller, url, b'{"trajectory_groups": ['),
        400,
        "not valid JSON",
    )


@pytest.mark.parametrize("route", ["log", "training-jobs"])
def test_nan_reward_is_refused_naming_the_trajectory(
    caller: Caller, refused: Refused, model_id: str, route: str
) -> None:
    bad = group(1.0, 0.0)
    bad["trajectories"][1]["reward"] = math.nan
    body = {"model_id": model_id, "trajectory_groups": [group(), bad]}
    url = f"/v1/models/{model_id}/log" if route == "log" else "/v1/training-jobs"
    refused(
        lambda: _post_raw(caller, url, json.dumps(body)),
        400,
        "trajectory_groups[1].trajectories[1].reward",
        "finite",
    )


@pytest.mark.parametrize("depth", [300, 5000])
def test_deeply_nested_bodies_are_refused(
    caller: Caller, refused: Refused, model_id: str, depth: int
) -> None:
    """Past pydantic's limit (200 levels) and past msgspec's (Python's recursion limit)."""
    nested = b"[" * depth + b"]" * depth
    body = b'{"trajectory_groups": [{"trajectories": [], "metadata": {"x": ' + nested + b"}}]}"
    refused(
        lambda: _post_raw(caller, f"/v1/models/{model_id}/log", body),
        400,
        "too deep" if depth > 1000 else "trajectory_groups[0]",
    )


def test_missing_messages_are_refused(caller: Caller, refused: Refused, model_id: str) -> None:
    bad = group()
    del bad["trajectories"][0]["messages_and_choices"]
    refused(
        lambda: caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [bad]}),
        400,
        "trajectory_groups[0].trajectories[0].messages_and_choices",
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"trajectory_groups": "all of them"}, "trajectory_groups: Input should be a valid list"),
        ({"trajectory_groups": []}, "trajectory_groups is empty"),
        ({"trajectory_groups": [{"trajectories": [trajectory(reward="high")]}]}, ".reward"),  # type: ignore[arg-type]
        ({"trajectory_groups": [group()], "split": "a b"}, "split:"),
        ({"trajectory_groups": [group()], "step": -1}, "step:"),
        ({"split": "val"}, "trajectory_groups: Field required"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(
    caller: Caller,
    refused: Refused,
    model_id: str,
    body: dict[str, Any],
    fragment: str,
) -> None:
    refused(
        lambda: caller.http.post(f"/v1/models/{model_id}/log", json=body),
        400,
        fragment,
    )


def test_a_body_over_the_limit_is_refused_before_parsing(
    caller: Caller, refused: Refused, model_id: str
) -> None:
    big = json.dumps({"trajectory_groups": [group()], "padding": "x" * (2 * 1024 * 1024)})
    refused(
        lambda: _post_raw(caller, f"/v1/models/{model_id}/log", big),
        413,
        "over the limit of 1048576 bytes",
    )


def test_a_chunked_body_over_the_limit_is_refused(
    caller: Caller, refused: Refused, model_id: str
) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the server must count
        yield b'{"trajectory_groups": [], "padding": "'
        for _ in range(40):
            yield b"x" * 64 * 1024
        yield b'"}'

    refused(
        lambda: _post_raw(caller, f"/v1/models/{model_id}/log", chunks()),
        413,
        "sent more than 1048576 bytes",
    )


def test_too_many_trajectories_are_refused(caller: Caller, refused: Refused, model_id: str) -> None:
    groups = [group(*([1.0] * 100)) for _ in range(6)]
    refused(
        lambda: caller.http.post(
            "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": groups}
        ),
        413,
        # Counted as the groups are read: the request stops at the first group past the limit.
        "more than 500 trajectories",
        "SKYTRAIN_MAX_TRAJECTORIES_PER_REQUEST",
    )


def test_choices_without_logprobs_are_refused_unless_allowed(
    caller: Caller, refused: Refused, model_id: str
) -> None:
    bare = group()
    bare["trajectories"][1]["messages_and_choices"][-1]["logprobs"] = None
    body = {"model_id": model_id, "trajectory_groups": [bare]}
    refused(
        lambda: caller.http.post("/v1/training-jobs", json=body),
        400,
        "trajectory 1 of group 0",
        "allow_training_without_logprobs",
    )
    allowed = caller.http.post(
        "/v1/training-jobs",
        json={**body, "config": {"allow_training_without_logprobs": True}},
    )
    assert allowed.status_code == 201


def test_a_token_id_too_long_to_be_one_is_refused_not_crashed(
    caller: Caller, refused: Refused, model_id: str
) -> None:
    hostile = group()
    content = hostile["trajectories"][0]["messages_and_choices"][-1]["logprobs"]["content"]
    content[0]["token"] = "token_id:" + "1" * 5000  # int() refuses more than 4,300 digits
    body = {"model_id": model_id, "trajectory_groups": [hostile]}
    refused(
        lambda: caller.http.post("/v1/training-jobs", json=body),
        400,
        "trajectory 0 of group 0",
    )


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"config": {"learning_rate": -1}}, "config.learning_rate"),
        ({"config": {"loss": "dpo"}}, "config.loss"),
        ({"config": {}, "experimental_config": {}}, "not both"),
        ({"experimental_config": {"learning_rate": "fast"}}, "experimental_config.learning_rate"),
    ],
)
def test_bad_training_configs_are_refused(
    caller: Caller,
    refused: Refused,
    model_id: str,
    extra: dict[str, Any],
    fragment: str,
) -> None:
    body = {"model_id": model_id, "trajectory_groups": [group()], **extra}
    refused(lambda: caller.http.post("/v1/training-jobs", json=body), 400, fragment)


def _sampled_at(step: int, *rewards: float) -> dict[str, Any]:
    """A group whose choices say they were sampled from ``step`` (as the gateway writes)."""
    sampled = group(*rewards)
    for item in sampled["trajectories"]:
        item["messages_and_choices"][-1]["skytrain_step"] = step
    return sampled


def test_groups_further_off_policy_than_allowed_are_refused_naming_the_group(
    caller: Caller,
    refused: Refused,
    model_id: str,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    for step in (1, 2, 3):
        add_checkpoint(
            db_sessions,
            object_store,
            tenant_id=caller.key.tenant_id,
            model_id=model_id,
            step=step,
            files={"adapter_config.json": b"{}"},
        )
    groups = [_sampled_at(3), _sampled_at(2, 0.0, 1.0), _sampled_at(1)]
    body = {"model_id": model_id, "trajectory_groups": groups}

    def send(limit: int) -> httpx.Response:
        return caller.http.post(
            "/v1/training-jobs", json={**body, "config": {"max_off_policy_steps": limit}}
        )

    refused(
        lambda: send(1),
        400,
        "trajectory_groups[2] was sampled from step 1, 2 steps before the model's current step 3",
        "max_off_policy_steps=1",
    )
    refused(lambda: send(-1), 400, "config.max_off_policy_steps")
    accepted = send(2)
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["config"]["max_off_policy_steps"] == 2
    # Without the option any lag is taken (the sampled logprobs are the old policy).
    assert caller.http.post("/v1/training-jobs", json=body).status_code == 201

    # ART's initial_policy_version (the step when the rollout began, as its PipelineTrainer
    # writes it) counts too, where the choices say no step.
    art = group()
    art["trajectories"][1]["initial_policy_version"] = 0
    art_body = {"model_id": model_id, "trajectory_groups": [_sampled_at(3), art]}
    refused(
        lambda: caller.http.post(
            "/v1/training-jobs", json={**art_body, "config": {"max_off_policy_steps": 2}}
        ),
        400,
        "trajectory_groups[1] was sampled from step 0, 3 steps before",
    )
    art["trajectories"][1]["initial_policy_version"] = -1
    refused(
        lambda: caller.http.post("/v1/training-jobs", json=art_body),
        400,
        "trajectories[1].initial_policy_version",
    )


def test_bad_sft_data_is_refused(caller: Caller, refused: Refused, model_id: str) -> None:
    no_answer = {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": 0}
    refused(
        lambda: caller.http.post(
            "/v1/sft-training-jobs", json={"model_id": model_id, "trajectories": [no_answer]}
        ),
        400,
        "trajectories[0]",
        "no assistant turn",
    )


def test_a_file_with_a_bad_line_is_refused(caller: Caller, refused: Refused, model_id: str) -> None:
    good = json.dumps(trajectory())
    refused(
        lambda: caller.http.post(
            "/v1/files", files={"file": ("d.jsonl", f"{good}\n{{oops\n".encode())}
        ),
        400,
        "line 2",
    )


def test_unknown_model_and_bad_paging_are_refused(
    caller: Caller, refused: Refused, model_id: str
) -> None:
    refused(
        lambda: caller.http.post("/v1/models/nope/log", json={"trajectory_groups": [group()]}),
        404,
        "model 'nope' not found",
    )
    refused(lambda: caller.http.get("/v1/models?limit=0"), 400, "query parameter limit")
    refused(lambda: caller.http.get("/v1/models?after=nope"), 400, "after='nope'")
