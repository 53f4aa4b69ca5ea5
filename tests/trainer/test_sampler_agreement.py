"""The trainer computes exactly what the sampler computed, for the conversations agents have.

Everything goes the way a user's agent goes: the official ``openai`` SDK samples each turn
through skytrain's gateway from a real CPU engine (the tiny model, or SmolLM2 for a real tool
call), the next request is built from the SDK's ``Trajectory.messages()``, the trajectory is
the SDK's ``Trajectory`` of the returned choices, dumped to JSON as ``model.train`` sends it,
and the trainer's ``prepare_rl`` measures the difference between its logprobs and the
sampler's on every sampled token, as every training job does before its first update.

Each case is one where the engine's prompt for a later turn is not the earlier prompt plus
the earlier sampled tokens (the test checks that it is not), so a trainer that spliced sampled
ids into a re-rendered conversation would be off there.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat.chat_completion import Choice

import skytrain
from skytrain_backend.app import create_app
from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys
from skytrain_backend.db.models import Model
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.engine.conversations import TOOLS
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import add_engine_worker, run_engine, serve_in_thread

# fp32 on both sides (CPU engine, CPU trainer): what is left is the order of operations.
FP32_NOISE = 1e-4

# Qwen3's way with assistant turns, on the tiny model's tokens: the turn after the last user
# message is written with a think block (an empty one when it has none), earlier turns lose
# theirs, and the generation prompt has none: so a finished conversation is never the prompt
# plus what was sampled.
QWEN3_STYLE_TEMPLATE = """\
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
{%- set content = message['content'] or '' -%}
{%- set reasoning = '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- content + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


@dataclass
class Gateway:
    url: str
    settings: Settings
    client: openai.OpenAI
    stack: ExitStack

    def serve(self, model_path: Path, base_model: str) -> str:
        """A model of ``base_model`` served by a new engine of ``model_path``; its name."""
        engine = self.stack.enter_context(
            run_engine(
                model_path, self.settings.storage.home / f"{base_model.replace('/', '-')}.log"
            )
        )
        sessions = session_factory(create_db_engine(self.settings.storage.resolved_database_url))
        worker_id = add_engine_worker(sessions, engine, base_model=base_model)
        response = self.client.post(
            "/models",
            cast_to=dict[str, Any],
            body={
                "project": "agreement",
                "name": base_model.split("/")[-1],
                "base_model": base_model,
            },
        )
        with sessions() as session:
            row = session.get(Model, response["id"])
            assert row is not None
            row.worker_id = worker_id
            session.commit()
        return str(response["inference_name"])


@pytest.fixture(scope="module")
def gateway(make_settings: MakeSettings) -> Iterator[Gateway]:
    settings = make_settings()
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(create_app(settings)))
        sessions = session_factory(create_db_engine(settings.storage.resolved_database_url))
        with sessions() as session:
            _, key = api_keys.create_key(session, tenant_name="agreement")
        client = stack.enter_context(
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
        )
        yield Gateway(url=url, settings=settings, client=client, stack=stack)


@pytest.fixture(scope="module")
def tiny(gateway: Gateway, tiny_model_path: Path) -> str:
    return gateway.serve(tiny_model_path, "tests/tiny")


@pytest.fixture(scope="module")
def qwen3_style_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that rewrites assistant turns as Qwen3's does."""
    directory = tmp_path_factory.mktemp("tiny-qwen3-style")
    for item in tiny_model_path.iterdir():
        shutil.copy(item, directory / item.name)
    (directory / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def trainers() -> dict[Path, Trainer]:
    return {}


def _trainer(trainers: dict[Path, Trainer], path: Path) -> Trainer:
    if path not in trainers:
        trainers[path] = Trainer.load(str(path), model_config=ModelConfig(), device="cpu")
    return trainers[path]


def _sample(client: openai.OpenAI, model: str, items: list[Any], **options: Any) -> Choice:
    messages = skytrain.Trajectory(messages_and_choices=items, reward=0).messages()
    completion = client.chat.completions.create(
        model=model,
        messages=messages,
        **({"max_tokens": 12, "temperature": 1.0} | options),
    )
    return completion.choices[0]


def _converse(
    client: openai.OpenAI, model: str, turns: list[list[dict[str, Any]]], **options: Any
) -> list[Any]:
    """Messages, then a sampled turn, for each entry of ``turns``."""
    items: list[Any] = []
    seed = options.pop("seed", 0)
    for k, messages in enumerate(turns):
        items += messages
        items.append(_sample(client, model, items, seed=seed + k, **options))
    return items


def _extends(later: Choice, earlier: Choice) -> bool:
    """Whether ``later``'s prompt is ``earlier``'s prompt plus ``earlier``'s sampled ids."""
    before = [*earlier.model_extra["prompt_token_ids"], *earlier.model_extra["token_ids"]]  # type: ignore[index]
    return later.model_extra["prompt_token_ids"][: len(before)] == before  # type: ignore[index]


def _non_canonical(
    client: openai.OpenAI, model: str, turns: list[list[dict[str, Any]]], count: int, start: int
) -> list[list[Any]]:
    """``count`` conversations whose first turn tokenizes differently when the engine renders
    it again (about half of them do on the tiny model), searching seeds from ``start``."""
    found = []
    for seed in range(start, start + 40 * count, 2):  # _converse uses seed and seed + 1
        items = _converse(client, model, turns, seed=seed)
        first = len(turns[0])  # the first sampled turn's index; the second follows turns[1]
        if not _extends(items[first + 1 + len(turns[1])], items[first]):
            found.append(items)
            if len(found) == count:
                return found
    raise AssertionError(f"no seed from {start} gave a non-canonical first turn")


def _agreement(
    trainer: Trainer, trajectories: list[skytrain.Trajectory], *, prompt_ids: bool = True
) -> dict[str, float]:
    """The agreement a training job on these trajectories measures (as the SDK sends them)."""
    raw = skytrain.TrajectoryGroup(trajectories).model_dump(mode="json")
    for trajectory in raw["trajectories"]:
        for history in [trajectory, *trajectory["additional_histories"]]:
            for item in history["messages_and_choices"]:
                if "message" in item:
                    assert item["prompt_token_ids"], "the SDK kept the choice's prompt ids"
                    if not prompt_ids:
                        del item["prompt_token_ids"]
    # A separate pass reads what a job's first step reads in its forward pass, without the
    # backward pass and update (tests/trainer/test_trainer.py shows the two agree).
    plan = trainer.prepare_rl(
        [TrajectoryGroup.model_validate(raw)], RLTrainConfig(), separate_pass=True
    )
    assert plan.warning is None
    return plan.summary


def _sampled_tokens(trajectories: list[skytrain.Trajectory]) -> int:
    histories = [h for t in trajectories for h in [t, *t.additional_histories]]
    return sum(
        len(item.logprobs.content)
        for history in histories
        for item in history.messages_and_choices
        if isinstance(item, Choice) and item.logprobs and item.logprobs.content
    )


def _check(
    trainer: Trainer, trajectories: list[skytrain.Trajectory], case: str
) -> dict[str, float]:
    with_ids = _agreement(trainer, trajectories)
    rendered = _agreement(trainer, trajectories, prompt_ids=False)
    print(
        f"\n{case}: max |sampler - trainer| = {with_ids['logprob_agreement/max_abs_diff']:.2e} "
        f"(mean {with_ids['logprob_agreement/mean_abs_diff']:.2e}) over "
        f"{with_ids['logprob_agreement/num_tokens']:.0f} tokens; without prompt ids "
        f"(rendered as the engine does): {rendered['logprob_agreement/max_abs_diff']:.2e}"
    )
    for summary in (with_ids, rendered):
        assert summary["logprob_agreement/num_tokens"] == _sampled_tokens(trajectories)
        assert summary["logprob_agreement/max_abs_diff"] < FP32_NOISE
    return with_ids


USER = {"role": "user", "content": "Write a short poem about the sea."}
FOLLOW_UP = {"role": "user", "content": "Now make it rhyme."}


@pytest.mark.slow
def test_two_turns_after_a_non_canonical_first_turn_agree(
    gateway: Gateway, tiny: str, tiny_model_path: Path, trainers: dict[Path, Trainer]
) -> None:
    conversations = _non_canonical(gateway.client, tiny, [[USER], [FOLLOW_UP]], 2, start=1)
    trajectories = [
        skytrain.Trajectory(messages_and_choices=items, reward=reward)
        for items, reward in zip(conversations, (1.0, 0.0), strict=True)
    ]
    summary = _check(_trainer(trainers, tiny_model_path), trajectories, "two turns, tiny model")
    # Each later turn is trained on its own prompt, not after the earlier turn's sampled ids.
    assert summary["sequences/trained"] == 4


@pytest.mark.slow
def test_a_template_that_rewrites_assistant_turns_agrees(
    gateway: Gateway, qwen3_style_path: Path, trainers: dict[Path, Trainer]
) -> None:
    model = gateway.serve(qwen3_style_path, "tests/tiny-qwen3-style")
    trainer = _trainer(trainers, qwen3_style_path)
    single = [
        skytrain.Trajectory(
            messages_and_choices=_converse(gateway.client, model, [[USER]], seed=seed),
            reward=reward,
        )
        for reward, seed in ((1.0, 1), (0.0, 2))
    ]
    # The template writes an empty think block into a finished last turn, not into the prompt.
    _check(trainer, single, "one turn, Qwen3-style template")
    # An earlier turn with a think block keeps it while it follows the last user message and
    # loses it once another user message comes: the second prompt rewrites the first.
    thinking = {"role": "assistant", "content": "<think>\nWaves, salt.\n</think>\n\nDraft:"}
    two = []
    for reward, seed in ((1.0, 3), (0.0, 4)):
        items = _converse(gateway.client, model, [[USER, thinking], [FOLLOW_UP]], seed=seed)
        assert not _extends(items[4], items[2])
        two.append(skytrain.Trajectory(messages_and_choices=items, reward=reward))
    _check(trainer, two, "two turns, Qwen3-style template")


@pytest.mark.slow
def test_additional_histories_agree(
    gateway: Gateway, tiny: str, tiny_model_path: Path, trainers: dict[Path, Trainer]
) -> None:
    helper = {"role": "user", "content": "Summarize: the sea is wide and deep."}
    mains = _non_canonical(gateway.client, tiny, [[USER], [FOLLOW_UP]], 2, start=101)
    subs = _non_canonical(gateway.client, tiny, [[helper], [FOLLOW_UP]], 2, start=201)
    trajectories = [
        skytrain.Trajectory(
            messages_and_choices=main,
            additional_histories=[skytrain.History(messages_and_choices=sub)],
            reward=reward,
        )
        for main, sub, reward in zip(mains, subs, (1.0, 0.0), strict=True)
    ]
    _check(_trainer(trainers, tiny_model_path), trajectories, "additional histories")


@pytest.mark.slow
def test_a_tool_call_with_non_canonical_whitespace_agrees(
    gateway: Gateway, smollm2_path: Path, trainers: dict[Path, Trainer]
) -> None:
    """SmolLM2 writes its call as compactly as the example it was shown; the engine parses
    it into ``tool_calls`` and renders them back with the template's spacing next turn."""
    model = gateway.serve(smollm2_path, "tests/smollm2")
    context = [
        {"role": "system", "content": "You are a weather assistant. Always call get_weather."},
        {"role": "user", "content": "What's the weather in London?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name":"get_weather","arguments":{"city":"London"}}</tool_call>',
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "rainy, 12 C"},
        {"role": "assistant", "content": "It is rainy in London, 12 C."},
        {"role": "user", "content": "What's the weather in Paris?"},
    ]
    trainer = _trainer(trainers, smollm2_path)
    call = _sample(
        gateway.client, model, context, tools=TOOLS, temperature=0.0, max_tokens=40, seed=0
    )
    assert call.message.tool_calls, call.message.content
    written = trainer.policy.tokenizer.decode(call.model_extra["token_ids"])  # type: ignore[index]
    assert '{"name":"get_weather","arguments":' in written  # not the template's spacing
    result = {"role": "tool", "tool_call_id": call.message.tool_calls[0].id, "content": "sunny"}
    trajectories = []
    for reward, seed in ((1.0, 1), (0.0, 2)):
        items = [*context, call, result]
        items.append(_sample(gateway.client, model, items, tools=TOOLS, max_tokens=8, seed=seed))
        assert not _extends(items[-1], call)
        trajectories.append(
            skytrain.Trajectory(messages_and_choices=items, tools=TOOLS, reward=reward)
        )
    summary = _check(trainer, trajectories, "tool call, SmolLM2")
    assert summary["sequences/trained"] == 4
