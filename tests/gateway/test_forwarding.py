"""Requests through the gateway reach the engine serving the named checkpoint, and come back
with the caller's model name, sampled-token logprobs with token ids, and what served them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from skytrain_backend.protocol import TOKEN_ID_PREFIX
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import (
    Engine,
    OnEngine,
    Tenant,
    add_checkpoint,
    load_adapter,
    mark_served,
)

PROMPT = [{"role": "user", "content": "Name a fruit."}]


def _token_ids(logprobs_content: list[object]) -> list[int]:
    tokens = [entry.token for entry in logprobs_content]  # type: ignore[attr-defined]
    assert all(token.startswith(TOKEN_ID_PREFIX) for token in tokens), tokens
    return [int(token.removeprefix(TOKEN_ID_PREFIX)) for token in tokens]


def test_chat_completion_answers_with_the_callers_name_and_token_id_logprobs(
    on_engine: OnEngine,
    engine_worker: str,
) -> None:
    alice, model = on_engine
    name = model["inference_name"]

    raw = alice.openai.chat.completions.with_raw_response.create(
        model=name, messages=PROMPT, max_tokens=6, temperature=1.0, seed=3, top_logprobs=2
    )
    completion = raw.parse()

    assert completion.model == name
    assert raw.headers["x-skytrain-model-id"] == model["id"]
    assert raw.headers["x-skytrain-step"] == "0"
    assert raw.headers["x-skytrain-worker"] == engine_worker
    # The caller did not ask for logprobs: the gateway always does, with token ids.
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(_token_ids(content)) == completion.usage.completion_tokens  # type: ignore[union-attr]
    assert all(entry.logprob <= 0 for entry in content)
    assert all(len(entry.top_logprobs) == 2 for entry in content)  # what the caller asked for


def test_completion_always_carries_logprobs_with_token_ids(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]

    completion = alice.openai.completions.create(model=name, prompt="Once upon", max_tokens=5)

    assert completion.model == name
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert all(token.startswith(TOKEN_ID_PREFIX) for token in logprobs.tokens)
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == 5


def test_every_chat_choice_carries_the_engines_prompt_ids_and_its_step_for_training(
    tenant: Callable[[], Tenant], engine_worker: str, engine: Engine
) -> None:
    """The gateway asks for vLLM's return_token_ids and copies the prompt ids, which vLLM
    answers once per response, onto each choice: the object a client keeps in its trajectory.
    Each choice (each streamed chunk's too) also says the step that sampled it."""
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    direct = engine.post(
        "/v1/chat/completions",
        {
            "model": engine.served_name,
            "messages": PROMPT,
            "max_tokens": 1,
            "return_token_ids": True,
        },
    ).json()

    completion = alice.openai.chat.completions.create(
        model=name, messages=PROMPT, max_tokens=5, n=2, seed=4
    )
    for choice in completion.choices:
        assert choice.model_extra["prompt_token_ids"] == direct["prompt_token_ids"]  # type: ignore[index]
        assert choice.model_extra["token_ids"] == _token_ids(choice.logprobs.content)  # type: ignore[index, union-attr]
        assert choice.model_extra["skytrain_step"] == 0  # type: ignore[index]

    chunks = list(
        alice.openai.chat.completions.create(
            model=name, messages=PROMPT, max_tokens=3, stream=True, seed=4
        )
    )
    first = chunks[0].choices[0]
    assert first.model_extra["prompt_token_ids"] == direct["prompt_token_ids"]  # type: ignore[index]
    assert {c.choices[0].model_extra["skytrain_step"] for c in chunks if c.choices} == {0}  # type: ignore[index]


def test_gateway_answers_exactly_what_the_engine_answers(
    tenant: Callable[[], Tenant], engine_worker: str, engine: Engine
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    request = {"messages": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11}

    through = alice.openai.chat.completions.create(model=name, **request)  # type: ignore[call-overload]
    direct = engine.post(
        "/v1/chat/completions",
        {
            **request,
            "model": engine.served_name,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        },
    ).json()

    assert through.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert _token_ids(through.choices[0].logprobs.content) == [  # type: ignore[union-attr]
        int(entry["token"].removeprefix(TOKEN_ID_PREFIX))
        for entry in direct["choices"][0]["logprobs"]["content"]
    ]


def test_stream_is_passed_through_with_the_callers_name_in_every_event(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    request = {"messages": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5}

    whole = alice.openai.chat.completions.create(model=name, **request)  # type: ignore[call-overload]
    chunks = list(
        alice.openai.chat.completions.create(
            model=name, stream=True, stream_options={"include_usage": True}, **request
        )  # type: ignore[call-overload]
    )

    assert len(chunks) > 2
    assert {chunk.model for chunk in chunks} == {name}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    streamed_ids = [
        token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for token in _token_ids(c.choices[0].logprobs.content or [])
    ]
    assert streamed_ids == _token_ids(whole.choices[0].logprobs.content)  # type: ignore[union-attr]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(streamed_ids)


def test_streamed_completion_carries_token_ids(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]

    chunks = list(
        alice.openai.completions.create(model=name, prompt="Once upon", max_tokens=4, stream=True)
    )

    assert {chunk.model for chunk in chunks} == {name}
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert len(tokens) == 4
    assert all(token.startswith(TOKEN_ID_PREFIX) for token in tokens)


def test_pinned_step_is_served_by_its_adapter_and_step0_by_the_base_model(
    on_engine: OnEngine,
    engine_worker: str,
    engine: Engine,
    gateway_plane: ServedPlane,
    step1_adapter: Path,
) -> None:
    alice, model = on_engine
    name = model["inference_name"]
    adapter = load_adapter(engine, model_id=model["id"], step=1, path=step1_adapter)
    add_checkpoint(gateway_plane.sessions, model_id=model["id"], step=1)
    mark_served(gateway_plane.sessions, worker_id=engine_worker, model_id=model["id"], step=1)
    greedy = {"messages": PROMPT, "max_tokens": 8, "temperature": 0.0}

    def ids(model_name: str) -> tuple[list[int], str]:
        raw = alice.openai.chat.completions.with_raw_response.create(model=model_name, **greedy)  # type: ignore[call-overload]
        completion = raw.parse()
        assert completion.model == model_name
        assert (
            str(completion.choices[0].model_extra["skytrain_step"])
            == raw.headers["x-skytrain-step"]
        )  # type: ignore[index]
        return _token_ids(completion.choices[0].logprobs.content), raw.headers["x-skytrain-step"]

    def engine_ids(engine_model: str) -> list[int]:
        body = {
            **greedy,
            "model": engine_model,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        }
        content = engine.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"][
            "content"
        ]
        return [int(entry["token"].removeprefix(TOKEN_ID_PREFIX)) for entry in content]

    assert engine_ids(adapter) != engine_ids(engine.served_name)  # the adapter changes answers
    assert ids(f"{name}:step1") == (engine_ids(adapter), "1")
    assert ids(f"{name}:step0") == (engine_ids(engine.served_name), "0")
    assert ids(name) == (engine_ids(adapter), "1")  # the latest step
    assert ids(f"wandb-artifact:///{name}:step1") == (engine_ids(adapter), "1")
    assert ids(f"wandb-artifact:///{name}") == (engine_ids(adapter), "1")
    assert ids(f"{model['id']}:step0") == (engine_ids(engine.served_name), "0")


def test_models_lists_ids_that_the_openai_client_can_sample_from(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice, bob = tenant(), tenant()
    mine = alice.create_model(worker_id=engine_worker)
    theirs = bob.create_model(worker_id=engine_worker)

    listed = alice.openai.models.list().data

    assert [entry.id for entry in listed] == [mine["id"]]
    assert listed[0].object == "model" and listed[0].owned_by == alice.name
    assert listed[0].created > 0
    completion = alice.openai.chat.completions.create(
        model=listed[0].id, messages=PROMPT, max_tokens=2
    )
    assert completion.model == mine["id"]
    assert theirs["id"] not in [entry.id for entry in listed]


def test_preview_prefix_serves_the_same_gateway(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]

    response = alice.http.post(
        "/v1/preview/chat/completions",
        json={"model": f"wandb-artifact:///{name}", "messages": PROMPT, "max_tokens": 3},
    )

    assert response.status_code == 200, response.text
    assert response.json()["model"] == f"wandb-artifact:///{name}"
    assert response.headers["x-skytrain-step"] == "0"


@pytest.mark.parametrize(
    ("path", "body", "logprobs"),
    [
        # Options the gateway lets through and only the engine refuses (ranges the gateway
        # checks itself never reach the engine).
        ("/v1/chat/completions", {"messages": PROMPT, "presence_penalty": 0.5}, True),
        ("/v1/completions", {"prompt": "Hi", "presence_penalty": 0.5}, 0),
    ],
)
def test_engine_refusal_passes_through_with_its_status_and_body(
    tenant: Callable[[], Tenant],
    engine_worker: str,
    engine: Engine,
    path: str,
    body: dict[str, object],
    logprobs: object,
) -> None:
    alice = tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]

    through = alice.http.post(path, json={**body, "model": name})
    direct = engine.post(
        path,
        {
            **body,
            "model": engine.served_name,
            "logprobs": logprobs,
            "return_tokens_as_token_ids": True,
        },
    )

    assert direct.status_code == 400
    assert through.status_code == 400
    assert "presence_penalty" in through.json()["error"]["message"]
    assert through.json() == direct.json()
