"""The /v1/preview routes speak ART's ServerlessBackend protocol.

The client here is the OpenAI SDK's generic HTTP client, the base ART's own client is built
on: the same cursor pagination (``after`` = the last item's id, ``has_more``), the same
request bodies, response models with ART's fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import ConflictError, OpenAI
from openai.pagination import SyncCursorPage
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import jobs
from skytrain_backend.protocol import RLTrainConfig
from skytrain_backend.storage import ObjectStore
from tests.api.support import add_checkpoint, group, sft_trajectory
from tests.fixtures.art import (
    ART_EVERY_OPTION,
    ArtCheckpoint,
    ArtDeleted,
    ArtEvent,
    ArtJob,
    ArtModel,
    art_train_request,
)
from tests.fixtures.callers import Caller
from tests.fixtures.services import ControlPlane


@pytest.fixture
def art(control_plane: ControlPlane, caller: Caller) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{control_plane.url}/v1", api_key=caller.key.key, max_retries=0) as c:
        yield c


def _checkpoints(art: OpenAI, model_id: str, **params: Any) -> list[ArtCheckpoint]:
    page = art.get_api_list(
        f"/preview/models/{model_id}/checkpoints",
        model=ArtCheckpoint,
        page=SyncCursorPage[ArtCheckpoint],
        options={"params": params},
    )
    return list(page)  # iterating follows has_more with after=<last id>


def test_art_register_log_train_and_delete_checkpoints(
    art: OpenAI, caller: Caller, db_sessions: sessionmaker[Session], object_store: ObjectStore
) -> None:
    body = {
        "entity": None,
        "project": "art",
        "name": "agent-001",
        "base_model": "tiny/llama",
        "return_existing": True,
    }
    model = art.post("/preview/models", cast_to=ArtModel, body=body)
    assert model.entity == caller.key.tenant_name
    assert art.post("/preview/models", cast_to=ArtModel, body=body).id == model.id

    # ART's _get_step: the newest checkpoint.
    assert [c.step for c in _checkpoints(art, model.id, limit=1, order="desc")][:1] == [0]

    groups = [group(1.0, 0.0), group(0.0, 0.0)]
    art.post(
        f"/preview/models/{model.id}/log",
        cast_to=type(None),
        body={"model_id": model.id, "trajectory_groups": groups, "split": "val"},
    )
    experimental = {
        "advantage_balance": None,
        "epsilon": None,
        "epsilon_high": None,
        "importance_sampling_level": None,
        "kimi_k2_tau": None,
        "learning_rate": 5e-6,
        "mask_prob_ratio": None,
        "max_negative_advantage_importance_sampling_weight": None,
        "ppo": None,
        "precalculate_logprobs": None,
        "scale_rewards": None,
    }
    job = art.post(
        "/preview/training-jobs",
        cast_to=ArtJob,
        body={
            "model_id": model.id,
            "trajectory_groups": groups,
            "experimental_config": experimental,
        },
    )
    with db_sessions() as session:
        jobs.add_event(session, job_id=job.id, type="training_started", data={"num_sequences": 1})
        # skytrain's own event, which ART's client has no type for: left out of its routes.
        jobs.add_event(session, job_id=job.id, type="job_timeline", data={"trainer": []})
        jobs.add_event(session, job_id=job.id, type="gradient_step", data={"loss/policy": 0.1})
        session.commit()
    events = list(
        art.get_api_list(
            f"/preview/training-jobs/{job.id}/events",
            model=ArtEvent,
            page=SyncCursorPage[ArtEvent],
            options={"params": {"limit": 1}},
        )
    )
    assert [e.type for e in events] == ["training_started", "gradient_step"]
    assert events[0].data["num_sequences"] == 1
    ours = caller.http.get(f"/v1/training-jobs/{job.id}/events").json()["data"]
    assert [e["type"] for e in ours] == ["training_started", "job_timeline", "gradient_step"]

    # Paging through every checkpoint, one per page, as ART's list does.
    listed = _checkpoints(art, model.id, limit=1)
    assert [c.step for c in listed] == [0]
    assert listed[0].metrics["val/reward"] == pytest.approx(0.25)
    # Step 0 is the model's only checkpoint: deleting it is refused.
    with pytest.raises(ConflictError, match="would leave model"):
        art.delete(
            f"/preview/models/{model.id}/checkpoints", cast_to=ArtDeleted, body={"steps": [0]}
        )
    add_checkpoint(
        db_sessions,
        object_store,
        tenant_id=caller.key.tenant_id,
        model_id=model.id,
        step=1,
        files={"adapter_config.json": b"{}"},
    )
    deleted = art.delete(
        f"/preview/models/{model.id}/checkpoints", cast_to=ArtDeleted, body={"steps": [0, 5]}
    )
    assert (deleted.deleted_count, deleted.not_found_steps) == (1, [5])
    art.delete(f"/preview/models/{model.id}", cast_to=type(None))
    assert caller.http.get(f"/v1/models/{model.id}").status_code == 404


def test_art_sft_job_from_an_uploaded_file(art: OpenAI, caller: Caller) -> None:
    model = caller.create_model()
    upload = caller.http.post(
        "/v1/preview/files",
        files={"file": ("d.jsonl", json.dumps(sft_trajectory()).encode(), "application/jsonl")},
    ).json()
    job = art.post(
        "/preview/sft-training-jobs",
        cast_to=ArtJob,
        body={
            "model_id": model["id"],
            "training_data_url": upload["uri"],
            "config": {"batch_size": 4, "learning_rate": 1e-4},
        },
    )
    assert caller.http.get(f"/v1/training-jobs/{job.id}").json()["kind"] == "sft"


def test_arts_train_request_is_accepted_with_its_defaults_and_every_option(
    art: OpenAI, caller: Caller
) -> None:
    """openpipe-art 0.5.23 sends every key of its experimental_config; each keeps ART's
    meaning, and what it leaves unsaid is ART's (``preset="art"``)."""
    model_id = caller.create_model()["id"]
    groups = [group(1.0, 0.0)]

    default = art.post(
        "/preview/training-jobs", cast_to=ArtJob, body=art_train_request(model_id, groups)
    )
    config = RLTrainConfig.model_validate(
        caller.http.get(f"/v1/training-jobs/{default.id}").json()["config"]
    )
    assert config == RLTrainConfig(preset="art")
    # CISPO with its weight clipped to [0, 5], ART's aggregation, steps and optimizer.
    assert (config.loss_fn, config.clip_range()) == ("cispo", (1.0, 4.0))
    assert (config.aggregation, config.num_gradient_steps) == ("art", "per_row")
    assert (config.adam_beta2, config.weight_decay, config.max_grad_norm) == (0.99, 0.1, 0.1)
    assert config.kl_penalty_source == "current_learner"

    every = art.post(
        "/preview/training-jobs",
        cast_to=ArtJob,
        body=art_train_request(model_id, groups, **ART_EVERY_OPTION),
    )
    config = RLTrainConfig.model_validate(
        caller.http.get(f"/v1/training-jobs/{every.id}").json()["config"]
    )
    assert config.model_dump(include=set(ART_EVERY_OPTION)) == ART_EVERY_OPTION
    assert (config.loss_fn, config.clip_range()) == ("ppo", (0.1, 0.3))
    ppo_defaults = RLTrainConfig.from_experimental(
        art_train_request(model_id, groups, ppo=True)["experimental_config"]
    )
    assert ppo_defaults.clip_range() == (0.2, 0.2)
    # A KL penalty without a source: ART's ServerlessBackend takes the sampler's logprobs.
    kl = RLTrainConfig.from_experimental(
        art_train_request(model_id, groups, kl_penalty_coef=0.1)["experimental_config"]
    )
    assert kl.kl_penalty_source == "sample"


def test_unknown_art_options_are_refused_naming_the_known_ones(art: OpenAI, caller: Caller) -> None:
    body = art_train_request(caller.create_model()["id"], [group(1.0, 0.0)])
    body["experimental_config"]["moe_routing_replay_path"] = "/tmp/routes"
    response = caller.http.post("/v1/preview/training-jobs", json=body)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "unsupported keys ['moe_routing_replay_path']" in message
    assert "advantage_balance" in message and "kl_penalty_source" in message
    assert "preset" not in message


def test_art_kl_references_that_are_not_the_models_own_checkpoints_are_refused(
    art: OpenAI, caller: Caller
) -> None:
    """ART's KL reference keys: a step the model has no checkpoint at, or a path (never read
    on the server), is a 400 naming the key; step 0, the base model, is always there."""
    body = art_train_request(caller.create_model()["id"], [group(1.0, 0.0)])
    for key, value, said in (
        ("kl_ref_adapter_path", "/etc", "kl_ref_adapter_path: it is not a checkpoint of model"),
        ("kl_penalty_reference_step", 3, "kl_penalty_reference_step=3: model"),
    ):
        sent = {**body, "experimental_config": {**body["experimental_config"], key: value}}
        response = caller.http.post("/v1/preview/training-jobs", json=sent)
        assert response.status_code == 400
        assert said in response.json()["error"]["message"]
        assert "/etc" not in response.json()["error"]["message"]
    sent = {
        **body,
        "experimental_config": {**body["experimental_config"], "kl_penalty_reference_step": 0},
    }
    assert caller.http.post("/v1/preview/training-jobs", json=sent).status_code == 201
