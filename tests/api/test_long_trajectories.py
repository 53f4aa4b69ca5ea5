"""A trajectory longer than its job's row is reported when the job is created: the trainer
cuts it to the row (under ART's rules, leaves it out), and before, only the job's
``tokens/truncated`` metric said so. The real control plane over HTTP; the trajectories
carry the sampler's ``prompt_token_ids`` and sampled ids as a skytrain endpoint returns them.
"""

from __future__ import annotations

from typing import Any

from tests.api.support import choice, group, trajectory
from tests.fixtures.callers import Caller


def _sampled(prompt_tokens: int | None, *, sampled: int = 2) -> dict[str, Any]:
    """A trajectory whose answer has ``sampled`` token ids after a prompt of
    ``prompt_tokens`` ids (None: the prompt's ids are not known)."""
    answer = choice(token_ids=tuple(range(19, 19 + sampled)))
    if prompt_tokens is not None:
        answer["prompt_token_ids"] = list(range(1, prompt_tokens + 1))
    result = trajectory()
    result["messages_and_choices"][-1] = answer
    return result


def _groups(*trajectories: dict[str, Any]) -> list[dict[str, Any]]:
    one = group()
    one["trajectories"] = list(trajectories)
    return [one]


def _job_on_64_token_rows(
    caller: Caller, groups: list[dict[str, Any]], config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A job of ``groups`` for a new model of 64-token rows, as created (201)."""
    model_id = caller.create_model(config={"max_seq_length": 64})["id"]
    body: dict[str, Any] = {"model_id": model_id, "trajectory_groups": groups}
    if config is not None:
        body["config"] = config
    response = caller.http.post("/v1/training-jobs", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_a_job_names_the_trajectories_longer_than_its_row_at_creation(caller: Caller) -> None:
    job = _job_on_64_token_rows(
        caller,
        _groups(
            _sampled(100),  # 102 tokens
            _sampled(70, sampled=3),  # 73 tokens
            _sampled(10),  # fits
            _sampled(None),  # its length is not known here: not counted
        ),
    )
    assert job["too_long"] == {
        "sequences": 2,
        "longest_tokens": 102,
        "row_tokens": 64,
    }


def test_a_job_whose_rows_hold_its_trajectories_reports_none(caller: Caller) -> None:
    job = _job_on_64_token_rows(
        caller,
        _groups(_sampled(100), _sampled(10)),
        {"packed_sequence_length": 128},  # the job's own row
    )
    assert job["too_long"] is None
