"""Temporal Clue: clue logic, generated puzzles have one answer, answer parsing and scoring."""

from __future__ import annotations

import pytest

from skytrain_backend.games.temporal_clue.play import (
    TemporalClueEpisode,
    parse_answer,
    score_answer,
)
from skytrain_backend.games.temporal_clue.play import (
    TemporalClueScenario as Scenario,
)
from skytrain_backend.games.temporal_clue.puzzle import (
    Cast,
    HappenedAfter,
    HappenedBefore,
    RoomEmpty,
    Solution,
    SuspectAt,
    SuspectNeverIn,
    SuspectStayed,
    WeaponAt,
    WeaponNeverIn,
    generate_puzzle,
    solve,
)
from tests.examples.choices import text_choice

CAST = Cast(
    suspects=("Miss Scarlet", "Mr. Green"),
    weapons=("Rope", "Knife"),
    rooms=("Hall", "Study", "Kitchen"),
    hours=("8 pm", "9 pm", "10 pm"),
)


def test_a_suspect_seen_in_a_room_at_the_murder_hour_is_the_murderer_only_if_it_is_that_room():
    clue = SuspectAt("Miss Scarlet", "Hall", "9 pm")
    assert clue.allows(Solution("Miss Scarlet", "Rope", "Hall", "9 pm"), CAST)
    assert not clue.allows(Solution("Miss Scarlet", "Rope", "Study", "9 pm"), CAST)
    # Someone else killed in the Hall at 9 pm: Scarlet would have been there too.
    assert not clue.allows(Solution("Mr. Green", "Rope", "Hall", "9 pm"), CAST)
    assert clue.allows(Solution("Mr. Green", "Rope", "Study", "9 pm"), CAST)
    # Other hours are not constrained by where Scarlet was at 9 pm.
    assert clue.allows(Solution("Miss Scarlet", "Rope", "Study", "8 pm"), CAST)


def test_weapon_and_stay_clues_follow_the_same_rule_over_their_hours():
    weapon = WeaponAt("Knife", "Kitchen", "8 pm")
    assert not weapon.allows(Solution("Mr. Green", "Knife", "Hall", "8 pm"), CAST)
    assert not weapon.allows(Solution("Mr. Green", "Rope", "Kitchen", "8 pm"), CAST)
    stayed = SuspectStayed("Mr. Green", "Study", "8 pm", "9 pm")
    assert not stayed.allows(Solution("Mr. Green", "Rope", "Hall", "9 pm"), CAST)
    assert stayed.allows(Solution("Mr. Green", "Rope", "Hall", "10 pm"), CAST)
    assert not stayed.allows(Solution("Miss Scarlet", "Rope", "Study", "8 pm"), CAST)


def test_never_empty_and_time_clues_rule_out_what_they_say():
    answer = Solution("Mr. Green", "Rope", "Hall", "9 pm")
    assert not SuspectNeverIn("Mr. Green", "Hall").allows(answer, CAST)
    assert SuspectNeverIn("Miss Scarlet", "Hall").allows(answer, CAST)
    assert not WeaponNeverIn("Rope", "Hall").allows(answer, CAST)
    assert not RoomEmpty("Hall", "9 pm").allows(answer, CAST)
    assert RoomEmpty("Hall", "8 pm").allows(answer, CAST)
    assert HappenedAfter("8 pm").allows(answer, CAST)
    assert not HappenedAfter("9 pm").allows(answer, CAST)
    assert HappenedBefore("10 pm").allows(answer, CAST)
    assert not HappenedBefore("9 pm").allows(answer, CAST)


def test_solve_finds_the_one_answer_a_hand_made_puzzle_allows():
    clues = [
        HappenedAfter("9 pm"),  # 10 pm
        SuspectAt("Miss Scarlet", "Kitchen", "10 pm"),
        SuspectAt("Mr. Green", "Study", "10 pm"),
        WeaponAt("Knife", "Study", "10 pm"),
        WeaponAt("Rope", "Hall", "10 pm"),
    ]
    assert solve(CAST, clues) == [Solution("Mr. Green", "Knife", "Study", "10 pm")]
    # Without knowing where the Rope was, Scarlet alone with it in the Kitchen also fits.
    assert set(solve(CAST, clues[:-1])) == {
        Solution("Mr. Green", "Knife", "Study", "10 pm"),
        Solution("Miss Scarlet", "Rope", "Kitchen", "10 pm"),
    }
    assert len(solve(CAST, clues[1:])) > 1  # without the time, other hours stay open


@pytest.mark.parametrize(
    "sizes",
    [
        {},
        {"suspects": 2, "weapons": 2, "rooms": 3, "hours": 2},
        {"suspects": 5, "weapons": 4, "rooms": 5, "hours": 6},
    ],
)
@pytest.mark.slow
def test_generated_puzzles_have_exactly_one_answer_and_no_spare_clue(sizes):
    for seed in range(25):
        puzzle = generate_puzzle(seed, **sizes)
        assert solve(puzzle.cast, puzzle.clues) == [puzzle.solution]
        for index in range(len(puzzle.clues)):
            fewer = puzzle.clues[:index] + puzzle.clues[index + 1 :]
            assert len(solve(puzzle.cast, fewer)) > 1


def test_puzzles_are_determined_by_their_seed():
    assert generate_puzzle(11).text() == generate_puzzle(11).text()
    assert generate_puzzle(11).solution == generate_puzzle(11).solution
    assert len({generate_puzzle(seed).text() for seed in range(10)}) == 10


def test_puzzle_text_lists_the_cast_the_rule_and_every_clue():
    puzzle = generate_puzzle(3)
    text = puzzle.text()
    assert all(name in text for name in puzzle.cast.suspects + puzzle.cast.rooms)
    assert "the only suspect in the murder room" in text
    assert all(f"{i}. {clue.text()}" in text for i, clue in enumerate(puzzle.clues, start=1))


@pytest.mark.parametrize(
    ("sizes", "message"),
    [({"rooms": 2}, "rooms must be between 3 and 6"), ({"suspects": 7}, "suspects must be")],
)
def test_sizes_the_generator_cannot_fill_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        generate_puzzle(0, **sizes)
    with pytest.raises(ValueError, match=message):
        Scenario(seed=0, **sizes)


def _answer_text(solution: Solution) -> str:
    return (
        "Thinking it through...\n<answer>\n"
        f"suspect: {solution.suspect}\nweapon: the {solution.weapon.lower()}\n"
        f"Room: {solution.room}.\ntime: {solution.time}\n</answer>"
    )


def test_parse_answer_reads_the_last_block_and_ignores_other_lines():
    text = "<answer>suspect: X</answer> then <answer>\nsuspect: Y\nmotive: money\n</answer>"
    assert parse_answer(text) == {"suspect": "Y"}
    assert parse_answer("suspect: Mr. Green") == {}


def test_scoring_counts_each_question_and_forgives_case_and_articles():
    solution = Solution("Mr. Green", "Lead Pipe", "Library", "9 pm")
    assert all(score_answer(parse_answer(_answer_text(solution)), solution).values())
    half = parse_answer(
        "<answer>\nsuspect: Mr. Green\nweapon: Rope\nroom: Hall\ntime: 9 PM\n</answer>"
    )
    assert score_answer(half, solution) == {
        "suspect": True,
        "weapon": False,
        "room": False,
        "time": True,
    }


def test_episode_rewards_the_fraction_of_questions_answered_right():
    scenario = Scenario(seed=5)
    right = TemporalClueEpisode(scenario)
    right.step(text_choice(_answer_text(right.puzzle.solution)))
    assert right.done and right.outcome == "answered"
    assert right.reward() == 1.0
    assert right.metrics()["solved"] is True

    wrong_time = TemporalClueEpisode(scenario)
    solution = wrong_time.puzzle.solution
    other_hour = next(h for h in wrong_time.puzzle.cast.hours if h != solution.time)
    wrong_time.step(
        text_choice(
            _answer_text(Solution(solution.suspect, solution.weapon, solution.room, other_hour))
        )
    )
    assert wrong_time.reward() == 0.75
    assert wrong_time.metrics()["correct_time"] is False


def test_episode_without_an_answer_block_scores_zero_after_one_turn():
    episode = TemporalClueEpisode(Scenario(seed=5))
    episode.step(text_choice("It was the butler.", finish_reason="length"))
    assert episode.outcome == "no_answer"
    assert episode.reward() == 0.0
    assert episode.metrics()["answered"] is False
