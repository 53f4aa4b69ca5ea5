"""The trainer trains on the token ids that were sampled, byte for byte."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import Trajectory, TrajectoryGroup
from skytrain_backend.trainer.tokenize import (
    TokenizedSequence,
    end_of_turn_token_id,
    tokenize_rl_groups,
    tokenize_sft_trajectories,
)
from tests.fixtures.sampling import choice_from_token_ids, sample_choices

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
PROMPT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return _encode(tokenizer, text)


def _sampled_ids(choice: dict[str, Any]) -> list[int]:
    return [
        int(entry["token"].removeprefix("token_id:")) for entry in choice["logprobs"]["content"]
    ]


def _trained_runs(sequence: TokenizedSequence) -> list[list[int]]:
    """The maximal runs of consecutive trained token ids."""
    runs: list[list[int]] = []
    for position, (token, trained) in enumerate(
        zip(sequence.token_ids, sequence.trained, strict=True)
    ):
        if trained:
            if position == 0 or not sequence.trained[position - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def _tokenize(
    tokenizer: Any, trajectories: list[dict[str, Any]], **options: Any
) -> list[TokenizedSequence]:
    group = TrajectoryGroup.model_validate({"trajectories": trajectories})
    batch = tokenize_rl_groups(
        tokenizer,
        [group],
        scale_rewards=True,
        allow_training_without_logprobs=options.pop("allow_training_without_logprobs", False),
        keep_zero_variance_groups=True,
    )
    return batch.sequences


def test_sampled_turns_are_trained_on_exactly_the_sampled_ids(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    choices = sample_choices(
        tiny_hf_model, tiny_tokenizer, PROMPT, n=4, max_new_tokens=12, seed=0, tools=TOOLS
    )
    sequences = _tokenize(
        tiny_tokenizer,
        [{"messages_and_choices": [*PROMPT, c], "tools": TOOLS, "reward": 0} for c in choices],
    )
    prompt = _prompt_ids(tiny_tokenizer, PROMPT, TOOLS)
    for sequence, choice in zip(sequences, choices, strict=True):
        sampled = _sampled_ids(choice)
        assert sequence.token_ids == prompt + sampled
        assert sequence.trained == [False] * len(prompt) + [True] * len(sampled)
        assert sequence.logprobs[len(prompt) :] == [
            entry["logprob"] for entry in choice["logprobs"]["content"]
        ]


def test_sampled_ids_win_over_retokenized_text(tiny_hf_model: Any, tiny_tokenizer: Any) -> None:
    eot = end_of_turn_token_id(tiny_tokenizer)
    split = _encode(tiny_tokenizer, "Par") + _encode(tiny_tokenizer, "is")  # "Paris" in 2 tokens
    assert _encode(tiny_tokenizer, "Paris") != split  # re-tokenizing the text would merge them
    choice = choice_from_token_ids(tiny_hf_model, tiny_tokenizer, PROMPT, [*split, eot])
    assert choice["message"]["content"] == "Paris"

    (sequence,) = _tokenize(
        tiny_tokenizer, [{"messages_and_choices": [*PROMPT, choice], "reward": 0}]
    )
    assert _trained_runs(sequence) == [[*split, eot]]
    rendered = tiny_tokenizer.apply_chat_template(
        [*PROMPT, {"role": "assistant", "content": "Paris"}], tokenize=False
    )
    assert sequence.token_ids != _encode(tiny_tokenizer, rendered)[: len(sequence.token_ids)]


def test_multi_turn_tool_calls_keep_every_sampled_id_and_the_template_between(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    eot = end_of_turn_token_id(tiny_tokenizer)
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    call_ids = [*_encode(tiny_tokenizer, call_text), eot]
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
            }
        ],
    }
    first = choice_from_token_ids(
        tiny_hf_model, tiny_tokenizer, PROMPT, call_ids, tools=TOOLS, message=call_message
    )
    tool_result = {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}
    context = [*PROMPT, call_message, tool_result]
    answer_ids = [*_encode(tiny_tokenizer, "Sunny"), *_encode(tiny_tokenizer, ", 18C"), eot]
    second = choice_from_token_ids(tiny_hf_model, tiny_tokenizer, context, answer_ids, tools=TOOLS)

    (sequence,) = _tokenize(
        tiny_tokenizer,
        [
            {
                "messages_and_choices": [*PROMPT, first, tool_result, second],
                "tools": TOOLS,
                "reward": 0,
            }
        ],
    )
    assert _trained_runs(sequence) == [call_ids, answer_ids]
    # Everything before the first sampled turn is the prompt the engine saw.
    first_prompt = _prompt_ids(tiny_tokenizer, PROMPT, TOOLS)
    assert sequence.token_ids[: len(first_prompt)] == first_prompt
    assert not any(sequence.trained[: len(first_prompt)])
    # The whole sequence reads as the template renders the conversation (minus the final "\n").
    rendered = tiny_tokenizer.apply_chat_template(
        [*context, {"role": "assistant", "content": "Sunny, 18C"}], tools=TOOLS, tokenize=False
    )
    assert tiny_tokenizer.decode(sequence.token_ids) == rendered.removesuffix("\n")
    trained_logprobs = [lp for lp, t in zip(sequence.logprobs, sequence.trained, strict=True) if t]
    expected = [e["logprob"] for c in (first, second) for e in c["logprobs"]["content"]]
    assert trained_logprobs == expected


def test_turn_cut_by_length_gets_the_template_closing_as_untrained_context(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    eot = end_of_turn_token_id(tiny_tokenizer)
    newline = _encode(tiny_tokenizer, "\n")
    cut = choice_from_token_ids(
        tiny_hf_model, tiny_tokenizer, PROMPT, _encode(tiny_tokenizer, "It is")
    )
    assert cut["finish_reason"] == "length"
    stopped = choice_from_token_ids(
        tiny_hf_model, tiny_tokenizer, PROMPT, [*_encode(tiny_tokenizer, "Sunny"), eot]
    )
    follow_up = {"role": "user", "content": "And tomorrow?"}
    for choice, closing in ((cut, [eot, *newline]), (stopped, newline)):
        later = choice_from_token_ids(
            tiny_hf_model, tiny_tokenizer, PROMPT, [*_encode(tiny_tokenizer, "Rain"), eot]
        )
        (sequence,) = _tokenize(
            tiny_tokenizer,
            [{"messages_and_choices": [*PROMPT, choice, follow_up, later], "reward": 0}],
        )
        sampled = _sampled_ids(choice)
        start = len(_prompt_ids(tiny_tokenizer, PROMPT))
        end = start + len(sampled)
        assert sequence.token_ids[start:end] == sampled
        # Only the closing tokens the model did not sample follow, untrained, then the user turn.
        after = sequence.token_ids[end : end + len(closing) + 1]
        assert after == [*closing, *_encode(tiny_tokenizer, "<|im_start|>")]
        assert not any(sequence.trained[end : end + len(closing)])
        assert sequence.token_ids.count(eot) == 5  # once per message, never twice


def test_additional_histories_are_trained_with_their_trajectory_advantage(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    sub_prompt = [{"role": "user", "content": "Look up the forecast."}]
    trajectories = []
    for reward, seed in ((1.0, 1), (0.0, 2)):
        main, sub = (
            sample_choices(
                tiny_hf_model, tiny_tokenizer, messages, n=1, max_new_tokens=6, seed=seed
            )[0]
            for messages in (PROMPT, sub_prompt)
        )
        trajectories.append(
            {
                "messages_and_choices": [*PROMPT, main],
                "additional_histories": [{"messages_and_choices": [*sub_prompt, sub]}],
                "reward": reward,
            }
        )
    sequences = _tokenize(tiny_tokenizer, trajectories)
    assert [(s.trajectory_index, s.history_index, s.advantage) for s in sequences] == [
        (0, 0, pytest.approx(1.0, abs=1e-5)),
        (0, 1, pytest.approx(1.0, abs=1e-5)),
        (1, 0, pytest.approx(-1.0, abs=1e-5)),
        (1, 1, pytest.approx(-1.0, abs=1e-5)),
    ]
    sub_ids = _sampled_ids(trajectories[1]["additional_histories"][0]["messages_and_choices"][-1])
    assert _trained_runs(sequences[3]) == [sub_ids]


def test_plain_assistant_messages_are_context_unless_training_without_logprobs(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    eot = end_of_turn_token_id(tiny_tokenizer)
    earlier = [
        *PROMPT,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Sure?"},
    ]
    choice = sample_choices(tiny_hf_model, tiny_tokenizer, earlier, n=1, max_new_tokens=5, seed=3)[
        0
    ]
    trajectory = {"messages_and_choices": [*earlier, choice], "reward": 0}

    (as_context,) = _tokenize(tiny_tokenizer, [trajectory])
    assert _trained_runs(as_context) == [_sampled_ids(choice)]

    (trained,) = _tokenize(tiny_tokenizer, [trajectory], allow_training_without_logprobs=True)
    assert trained.token_ids == as_context.token_ids
    plain_ids = [*_encode(tiny_tokenizer, "Sunny."), eot]
    assert _trained_runs(trained) == [plain_ids, _sampled_ids(choice)]
    plain_logprobs = [lp for lp, t in zip(trained.logprobs, trained.trained, strict=True) if t]
    assert all(math.isnan(lp) for lp in plain_logprobs[: len(plain_ids)])
    assert not any(math.isnan(lp) for lp in plain_logprobs[len(plain_ids) :])


def test_sft_trains_all_assistant_turns_or_only_the_last(tiny_tokenizer: Any) -> None:
    eot = end_of_turn_token_id(tiny_tokenizer)
    trajectory = Trajectory.model_validate(
        {
            "messages_and_choices": [
                *PROMPT,
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "Tomorrow?"},
                {"role": "assistant", "content": "Rain."},
            ],
            "reward": 0,
        }
    )
    first, last = (
        [*_encode(tiny_tokenizer, "Sunny."), eot],
        [*_encode(tiny_tokenizer, "Rain."), eot],
    )
    (every,) = tokenize_sft_trajectories(tiny_tokenizer, [trajectory], assistant_turns="all")
    (only_last,) = tokenize_sft_trajectories(tiny_tokenizer, [trajectory], assistant_turns="last")
    assert _trained_runs(every) == [first, last]
    assert _trained_runs(only_last) == [last]
    assert every.token_ids == only_last.token_ids


def test_sft_refuses_a_trajectory_without_assistant_turns(tiny_tokenizer: Any) -> None:
    trajectory = Trajectory.model_validate({"messages_and_choices": PROMPT, "reward": 0})
    with pytest.raises(TrainingError, match="trajectory 0 has no assistant turn"):
        tokenize_sft_trajectories(tiny_tokenizer, [trajectory], assistant_turns="all")


def test_a_later_turn_on_a_prompt_that_does_not_extend_the_earlier_tokens_is_its_own_sequence(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    """Sampled as "Par" + "is", rendered again as "Paris": the engine's second prompt is not the
    first prompt plus the sampled ids, so the second turn is trained after its own prompt."""
    eot = end_of_turn_token_id(tiny_tokenizer)
    split = [*_encode(tiny_tokenizer, "Par"), *_encode(tiny_tokenizer, "is"), eot]
    first = choice_from_token_ids(tiny_hf_model, tiny_tokenizer, PROMPT, split)
    first["prompt_token_ids"] = _prompt_ids(tiny_tokenizer, PROMPT)
    follow_up = {"role": "user", "content": "And tomorrow?"}
    context = [*PROMPT, {"role": "assistant", "content": "Paris"}, follow_up]
    second = choice_from_token_ids(
        tiny_hf_model, tiny_tokenizer, context, [*_encode(tiny_tokenizer, "Rain"), eot]
    )
    second["prompt_token_ids"] = _prompt_ids(tiny_tokenizer, context)
    trajectory = {"messages_and_choices": [*PROMPT, first, follow_up, second], "reward": 0}

    for given in (True, False):  # the engine's prompt ids, or rendered as the engine renders
        if not given:
            del first["prompt_token_ids"], second["prompt_token_ids"]
        one, two = _tokenize(tiny_tokenizer, [trajectory])
        assert one.token_ids == _prompt_ids(tiny_tokenizer, PROMPT) + split
        assert two.token_ids == _prompt_ids(tiny_tokenizer, context) + _sampled_ids(second)
        assert _trained_runs(one) == [split]
        assert _trained_runs(two) == [_sampled_ids(second)]
        assert (one.trajectory_index, one.history_index) == (two.trajectory_index, 0)


def test_the_engines_prompt_ids_are_trained_on_as_given(
    tiny_hf_model: Any, tiny_tokenizer: Any
) -> None:
    choice = sample_choices(tiny_hf_model, tiny_tokenizer, PROMPT, n=1, max_new_tokens=4, seed=1)[0]
    # Whatever the engine rendered (here: another system prompt) is what the turn followed.
    engine_prompt = _prompt_ids(tiny_tokenizer, [{"role": "system", "content": "Hi."}, PROMPT[1]])
    choice["prompt_token_ids"] = engine_prompt
    (sequence,) = _tokenize(
        tiny_tokenizer, [{"messages_and_choices": [*PROMPT, choice], "reward": 0}]
    )
    assert sequence.token_ids == engine_prompt + _sampled_ids(choice)
