"""The demo's task without a server: the reward, the train/held-out split, the question order
of each step, and the table and plot it reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from skytrain_backend.demo import report, task
from skytrain_backend.demo.training import StepRow, training_batches

PARIS = task.Question("What is the capital of France?", frozenset({"paris"}))


def test_held_out_questions_are_never_trained_on() -> None:
    train, held_out = task.split_questions()
    assert len(train) + len(held_out) == len(task.QUESTIONS)
    assert len(held_out) == 16
    assert {q.text for q in train}.isdisjoint({q.text for q in held_out})
    assert task.split_questions() == (train, held_out)  # fixed, not random


def test_every_question_has_an_accepted_answer_of_one_word() -> None:
    for question in task.QUESTIONS:
        assert question.answers, question.text
        for answer in question.answers:
            assert task.words(answer) == [answer], (question.text, answer)


def test_the_prompt_asks_for_one_word() -> None:
    assert PARIS.messages() == [
        {"role": "user", "content": "What is the capital of France? Answer with one word."}
    ]


@pytest.mark.parametrize("answer", ["Paris", "Paris.", "**Paris**", " paris!\n", "PARIS"])
def test_the_right_single_word_earns_the_whole_reward(answer: str) -> None:
    result = task.score(PARIS, answer, finish_reason="stop")
    assert result.reward == pytest.approx(1.0)
    assert result.correct and result.num_words == 1
    assert result.metrics()["one_word"] == 1.0


def test_a_sentence_earns_brevity_in_proportion_to_its_words() -> None:
    sentence = task.score(PARIS, "The capital of France is Paris.", finish_reason="stop")
    assert sentence.num_words == 6 and sentence.correct
    assert sentence.reward == pytest.approx(task.BREVITY_WEIGHT / 6 + task.CORRECTNESS_WEIGHT)
    two_words = task.score(PARIS, "Paris, France", finish_reason="stop")
    assert two_words.reward == pytest.approx(task.BREVITY_WEIGHT / 2 + task.CORRECTNESS_WEIGHT)
    assert 1.0 > two_words.reward > sentence.reward


def test_a_wrong_single_word_earns_brevity_only() -> None:
    result = task.score(PARIS, "London", finish_reason="stop")
    assert not result.correct
    assert result.reward == pytest.approx(task.BREVITY_WEIGHT)


def test_a_right_sentence_beats_a_wrong_word() -> None:
    sentence = task.score(PARIS, "The capital of France is Paris.", finish_reason="stop")
    assert sentence.reward > task.score(PARIS, "London", finish_reason="stop").reward


@pytest.mark.parametrize(
    ("answer", "finish_reason"),
    [("The capital of France is Paris, a city", "length"), ("", "stop"), ("...", "stop")],
)
def test_a_cut_off_or_empty_answer_earns_nothing(answer: str, finish_reason: str) -> None:
    result = task.score(PARIS, answer, finish_reason=finish_reason)
    assert result.reward == 0.0
    assert result.metrics()["one_word"] == 0.0


def test_rewards_lie_between_zero_and_one() -> None:
    answers = ["", "Paris", "no", "Paris Paris Paris", "It is Paris, not London or Rome."]
    for answer in answers:
        for finish_reason in ("stop", "length", None):
            assert 0.0 <= task.score(PARIS, answer, finish_reason=finish_reason).reward <= 1.0


def test_each_step_takes_new_training_questions_until_all_are_used() -> None:
    train, _ = task.split_questions()
    batches = training_batches(train, steps=6, per_step=8, seed=0)
    assert [len(batch) for batch in batches] == [8] * 6
    first_pass = [q for batch in batches for q in batch]
    assert len(set(first_pass)) == len(train) == 48
    assert training_batches(train, steps=6, per_step=8, seed=0) == batches
    assert training_batches(train, steps=6, per_step=8, seed=1) != batches
    # Past the end of the list the order starts over.
    assert training_batches(train, steps=7, per_step=8, seed=0)[6] == batches[0]


ROWS = [
    StepRow(
        step=0,
        train_reward=None,
        eval_reward=0.15,
        seconds=20.0,
        eval_metrics={"one_word": 0.1, "correct": 0.2},
    ),
    StepRow(
        step=1,
        train_reward=0.2,
        eval_reward=0.45,
        seconds=41.0,
        eval_metrics={"one_word": 0.4, "correct": 0.3},
    ),
]


def test_the_table_shows_each_step_and_its_rewards() -> None:
    lines = report.table(ROWS).splitlines()
    assert lines[0].split()[:3] == ["step", "train", "reward"]
    assert lines[1].split() == ["0", "-", "0.150", "10%", "20%", "20"]
    assert lines[2].split() == ["1", "0.200", "0.450", "40%", "30%", "41"]


def test_the_plot_is_a_png_image(tmp_path: Path) -> None:
    path = tmp_path / "rewards.png"
    report.plot(ROWS, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 400 and height > 300


def test_the_csv_has_one_line_per_step(tmp_path: Path) -> None:
    path = tmp_path / "rewards.csv"
    report.write_csv(ROWS, path)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("step,train_reward,eval_reward")
    assert lines[1].startswith("0,,0.1500")
    assert lines[2].startswith("1,0.2000,0.4500")


@pytest.mark.slow
def test_the_demo_starts_without_importing_torch() -> None:
    # The demo is a client plus a control plane: torch loads only in the worker it starts.
    code = "import sys, skytrain_backend.demo; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
