"""Email search: generated inboxes, keyword search, tools, answer scoring, malformed calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice

from examples.email_search.agent import (
    TOOLS,
    EmailSearchEpisode,
    Scenario,
    score_answer,
)
from examples.email_search.inbox import Question, generate_scenario
from tests.examples.choices import text_choice, tool_choice


def test_inbox_and_question_are_determined_by_the_seed():
    first, again = generate_scenario(4), generate_scenario(4)
    assert first == again
    assert len(first.inbox.emails) == 20
    assert len({generate_scenario(seed).question for seed in range(10)}) == 10


def test_each_question_names_exactly_one_email_which_holds_the_answer():
    for seed in range(100):
        scenario = generate_scenario(seed, size=12)
        question = scenario.question
        named = [email.id for email in scenario.inbox.emails if question.key in email.subject]
        assert named == [question.source_id]
        source = scenario.inbox.read(question.source_id)
        assert source is not None and question.answer in source.body


def test_search_ranks_emails_matching_more_keywords_first():
    scenario = generate_scenario(4)
    question = scenario.question
    hits = scenario.inbox.search([question.key, "zebra"])
    assert hits[0].id == question.source_id
    source = scenario.inbox.read(question.source_id)
    assert source is not None and hits[0].subject == source.subject
    assert len(scenario.inbox.search(["the", "a", "your"], limit=3)) <= 3


def test_search_is_case_insensitive_matches_whole_words_and_may_find_nothing():
    scenario = generate_scenario(4)
    key = scenario.question.key
    assert scenario.inbox.search([key.upper()])[0].id == scenario.question.source_id
    assert scenario.inbox.search(["qqqq"]) == []
    assert scenario.inbox.search([key[:2].lower() + "qq"]) == []


def test_read_returns_none_for_an_unknown_id():
    assert generate_scenario(0).inbox.read("m999") is None


QUESTION = Question(text="?", answer="8:30 pm", source_id="m004", key="Nordlys")


@pytest.mark.parametrize(
    ("text", "source_id", "turns", "reward"),
    [
        ("Your table is at 8:30 PM.", "m004", 3, 1.0),
        ("8:30pm", "m004", 2, 1.0),
        ("8:30 pm", "m007", 3, 0.7),
        ("9 pm", "m004", 3, 0.4),
        ("no idea", "", 3, 0.1),
        ("8:30 pm", "m004", 5, 0.96),
        ("no idea", "", 20, 0.0),
    ],
)
def test_answer_reward_values_correctness_then_citation_then_few_turns(
    text, source_id, turns, reward
):
    assert score_answer(QUESTION, text=text, source_id=source_id, turns=turns) == pytest.approx(
        reward
    )


def _tool_messages(episode: EmailSearchEpisode) -> list[dict[str, Any]]:
    return [dict(m) for m in episode.messages() if m["role"] == "tool"]


def test_search_read_answer_earns_the_full_reward():
    episode = EmailSearchEpisode(Scenario(seed=9))
    question = episode.question
    assert episode.tools == TOOLS
    assert episode.messages()[1] == {"role": "user", "content": f"Question: {question.text}"}

    search = tool_choice(("search_emails", {"keywords": [question.key]}))
    episode.step(search)
    hits = json.loads(_tool_messages(episode)[-1]["content"])
    assert hits[0]["id"] == question.source_id
    assert _tool_messages(episode)[-1]["tool_call_id"] == "call_0"
    assert episode.messages_and_choices[2] is search

    episode.step(tool_choice(("read_email", {"id": question.source_id})))
    assert question.answer in json.loads(_tool_messages(episode)[-1]["content"])["email"]

    episode.step(
        tool_choice(("answer", {"text": question.answer, "source_id": question.source_id}))
    )
    assert episode.outcome == "answered"
    assert episode.reward() == 1.0
    metrics = episode.metrics()
    assert (metrics["correct"], metrics["cited"], metrics["searches"], metrics["reads"]) == (
        True,
        True,
        1,
        1,
    )
    assert isinstance(episode.messages_and_choices[-1], Choice)


def test_assistant_turns_are_sent_back_with_their_tool_calls():
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(tool_choice(("search_emails", {"keywords": ["flight"]})))
    assistant: dict[str, Any] = dict(episode.messages()[2])
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"][0]["function"] == {
        "name": "search_emails",
        "arguments": '{"keywords": ["flight"]}',
    }
    assert assistant["tool_calls"][0]["id"] == "call_0"


def test_several_calls_in_one_turn_each_get_their_result():
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(
        tool_choice(("search_emails", {"keywords": ["invoice"]}), ("read_email", {"id": "m001"}))
    )
    assert [m["tool_call_id"] for m in _tool_messages(episode)] == ["call_0", "call_1"]
    assert not episode.done


def test_reading_an_unknown_id_is_an_error_message_not_the_end():
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(tool_choice(("read_email", {"id": "nope"})))
    assert json.loads(_tool_messages(episode)[-1]["content"]) == {
        "error": "no email with id 'nope'"
    }
    assert not episode.done


def test_wrong_answer_with_wrong_source_earns_only_the_format_reward():
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(tool_choice(("answer", {"text": "no idea", "source_id": "m999"})))
    assert episode.reward() == pytest.approx(0.1)
    assert episode.metrics()["correct"] is False


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (("search_emails", "{not json"), "not valid JSON"),
        (("search_emails", {"keywords": "flight"}), "'keywords' must be a list"),
        (("search_emails", {"keywords": []}), "non-empty list of strings"),
        (("read_email", {"email_id": "m001"}), "'id' must be a str"),
        (("answer", {"text": "8:30 pm"}), "'source_id' must be a str"),
        (("delete_email", {"id": "m001"}), "unknown tool 'delete_email'"),
        (("answer", "[1, 2]"), "must be a JSON object"),
    ],
)
def test_malformed_calls_end_the_episode_with_zero_reward(call, problem):
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(tool_choice(call))
    assert episode.outcome == "malformed_call"
    assert episode.reward() == 0.0
    assert problem in episode.metadata()["malformed"]
    assert episode.metrics()["malformed_call"] is True


def test_a_turn_without_a_tool_call_ends_the_episode_with_zero_reward():
    episode = EmailSearchEpisode(Scenario(seed=9))
    episode.step(text_choice(f"The answer is {episode.question.answer}"))
    assert episode.outcome == "no_tool_call"
    assert episode.reward() == 0.0


def test_searching_forever_stops_at_the_turn_limit_with_zero_reward():
    episode = EmailSearchEpisode(Scenario(seed=9), max_turns=3)
    for _ in range(3):
        episode.step(tool_choice(("search_emails", {"keywords": ["lunch"]})))
    assert episode.outcome == "turn_limit"
    assert episode.reward() == 0.0
    assert episode.metrics()["searches"] == 3
    assert isinstance(episode.messages_and_choices[-1], Choice)  # no tool reply after the end
