"""Trajectory logs: stored as JSONL + a row with summary metrics, merged into checkpoints."""

from __future__ import annotations

import pytest

from skytrain_backend.storage import ObjectStore, compression, keys
from tests.api.support import group
from tests.fixtures.callers import Caller
from tests.fixtures.services import ON_EVERY_BACKEND

pytestmark = ON_EVERY_BACKEND


@pytest.mark.slow
def test_log_stores_batch_with_summary_metrics(caller: Caller, object_store: ObjectStore) -> None:
    model_id = caller.create_model()["id"]
    groups = [group(1.0, 0.0, correct=1.0), group(0.5, 0.5, correct=0.0)]
    response = caller.http.post(
        f"/v1/models/{model_id}/log", json={"trajectory_groups": groups, "split": "val"}
    )
    assert response.status_code == 201
    batch = response.json()
    assert batch["step"] == 0
    assert batch["num_groups"] == 2
    assert batch["num_trajectories"] == 4
    metrics = batch["metrics"]
    assert metrics["reward"] == pytest.approx(0.5)
    assert metrics["reward_std_dev"] == pytest.approx((0.125) ** 0.5)
    assert (metrics["reward/min"], metrics["reward/max"]) == (0.0, 1.0)
    assert metrics["correct"] == pytest.approx(0.5)

    key = keys.log_key(tenant_id=caller.key.tenant_id, model_id=model_id, batch_id=batch["id"])
    lines = compression.decompress(object_store.get_bytes(key)).decode().splitlines()
    assert len(lines) == 2
    detail = caller.http.get(f"/v1/models/{model_id}/logs/{batch['id']}").json()
    assert detail["num_trajectories"] == 4
    rewards = [t["reward"] for g in detail["trajectory_groups"] for t in g["trajectories"]]
    assert rewards == [1.0, 0.0, 0.5, 0.5]
    # ART's initial_policy_version, sent as None: kept as "not said".
    assert detail["trajectory_groups"][0]["trajectories"][0]["initial_policy_version"] is None


def test_log_merges_split_metrics_into_the_checkpoint_at_that_step(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group(1.0, 0.0)]})
    caller.http.post(
        f"/v1/models/{model_id}/log",
        json={"trajectory_groups": [group(1.0, 1.0)], "split": "train"},
    )
    step0 = caller.http.get(f"/v1/models/{model_id}/checkpoints/0").json()
    assert step0["metrics"]["val/reward"] == pytest.approx(0.5)
    assert step0["metrics"]["train/reward"] == pytest.approx(1.0)
    assert step0["metrics"]["val/num_trajectories"] == 2


def test_the_checkpoint_gets_every_batch_of_a_step_combined_as_the_history_shows(
    caller: Caller,
) -> None:
    model_id = caller.create_model()["id"]
    url = f"/v1/models/{model_id}/log"
    caller.http.post(url, json={"trajectory_groups": [group(0.0, 0.0)]})
    caller.http.post(url, json={"trajectory_groups": [group(1.0, 1.0)]})
    step0 = caller.http.get(f"/v1/models/{model_id}/checkpoints/0").json()["metrics"]
    (history,) = caller.http.get(f"/v1/models/{model_id}/metrics").json()["data"]
    assert step0["val/reward"] == pytest.approx(0.5)  # not the last batch's 1.0
    assert step0["val/num_trajectories"] == 4
    assert step0 == pytest.approx({f"val/{k}": v for k, v in history["metrics"].items()})


def test_logs_list_filters_by_split_and_step(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    url = f"/v1/models/{model_id}/log"
    ids = [
        caller.http.post(url, json={"trajectory_groups": [group()], "split": s, "step": n}).json()[
            "id"
        ]
        for s, n in (("val", 0), ("train", 0), ("val", 1))
    ]
    listed = caller.http.get(f"/v1/models/{model_id}/logs", params={"split": "val"}).json()
    assert [b["id"] for b in listed["data"]] == [ids[0], ids[2]]
    at_step = caller.http.get(f"/v1/models/{model_id}/logs", params={"step": 0}).json()
    assert [b["id"] for b in at_step["data"]] == ids[:2]
    paged = caller.http.get(
        f"/v1/models/{model_id}/logs", params={"after": ids[0], "limit": 1}
    ).json()
    assert [b["id"] for b in paged["data"]] == [ids[1]]
    assert paged["has_more"] is True


def test_metrics_history_has_one_point_per_step_and_split(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    url = f"/v1/models/{model_id}/log"
    caller.http.post(url, json={"trajectory_groups": [group(0.0, 0.0)], "step": 0})
    caller.http.post(url, json={"trajectory_groups": [group(1.0, 1.0)], "step": 0})
    caller.http.post(url, json={"trajectory_groups": [group(1.0, 1.0)], "step": 1})
    caller.http.post(url, json={"trajectory_groups": [group(0.0)], "step": 1, "split": "train"})
    history = caller.http.get(f"/v1/models/{model_id}/metrics", params={"split": "val"}).json()
    points = [(p["step"], p["split"]) for p in history["data"]]
    assert points == [(0, "val"), (1, "val")]
    combined = history["data"][0]["metrics"]
    assert combined["reward"] == pytest.approx(0.5)
    assert combined["reward_std_dev"] == pytest.approx(0.5)  # pooled over both batches
    assert combined["num_trajectories"] == 4
    everything = caller.http.get(f"/v1/models/{model_id}/metrics").json()["data"]
    assert [(p["step"], p["split"]) for p in everything] == [(0, "val"), (1, "train"), (1, "val")]
