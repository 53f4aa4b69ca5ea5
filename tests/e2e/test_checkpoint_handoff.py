"""The checkpoint hand-off's durability rule, with a real worker, engine and control plane:
the worker loads a new step into its engine while the checkpoint uploads, but no one is
served that step until its checkpoint is committed. Here the commit fails for real (the
local object store cannot make the checkpoint's directory): the gateway answers with the old step
throughout and refuses the new one, and the engine has unloaded it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from skytrain_backend import tls
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.protocol import lora_name
from skytrain_backend.storage import keys
from tests.e2e import support
from tests.fixtures.service import Service
from tests.gateway.conftest import wait_until

pytestmark = [pytest.mark.e2e]

T = TypeVar("T")


def _row(service: Service, kind: type[T], row_id: str) -> T:
    engine = create_engine(f"sqlite:///{service.home / 'skytrain.db'}")
    try:
        with Session(engine, expire_on_commit=False) as session:
            return session.get_one(kind, row_id)
    finally:
        engine.dispose()


def _engine_adapters(service: Service, model_id: str) -> set[str]:
    """The adapters the model's worker's engine holds, asked through its front door."""
    worker_id = _row(service, Model, model_id).worker_id
    assert worker_id is not None
    worker = _row(service, Worker, worker_id)
    endpoint, secret = worker.engine_endpoint, worker.engine_secret
    certificate = worker.engine_certificate
    assert endpoint and secret and certificate
    with httpx.Client(verify=tls.pinned_context(certificate), timeout=30) as http:
        response = http.get(f"{endpoint}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    response.raise_for_status()
    return {item["id"] for item in response.json()["data"] if model_id in item["id"]}


def _sample_until(
    client: openai.OpenAI, model: str, done: threading.Event, steps: list[str]
) -> None:
    """Sample the model's latest step until ``done``, recording the step that answered."""
    while not done.is_set():
        _, headers = support.sample(client, model, "Say hello.", n=1, max_tokens=2)
        steps.append(headers["x-skytrain-step"])


@pytest.mark.slow
def test_a_step_whose_commit_failed_is_never_served_and_is_unloaded(
    embedded_service: Service, tiny_model_path: Path
) -> None:
    service = embedded_service
    with service.http("alice") as http:
        created = http.post(
            "/v1/models",
            json={"project": "handoff", "name": "lost", "base_model": str(tiny_model_path)},
        )
        assert created.status_code == 201, created.text
        model: dict[str, Any] = created.json()
        support.wait_until_served(http, model["id"])
        client = support.openai_client(service.url, service.key("alice"))
        groups = support.sample_groups(client, model["inference_name"], groups=2, n=4)
        tenant_id = _row(service, Model, model["id"]).tenant_id
        prefix = keys.model_prefix(tenant_id=tenant_id, model_id=model["id"])

        served_steps: list[str] = []
        done = threading.Event()
        sampler = threading.Thread(
            target=_sample_until, args=(client, model["inference_name"], done, served_steps)
        )
        # A file stands where the model's checkpoints/ directory goes in the store: committing
        # step 1 fails there (the store's own error), after the worker loaded the step.
        blocker = service.home / "objects" / prefix / "checkpoints"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_bytes(b"")
        sampler.start()
        try:
            _, events = support.train(http, model["id"], groups, learning_rate=5e-3)
        finally:
            done.set()
            sampler.join()

        assert events[-1]["type"] == "training_failed", events[-1]
        assert "saving the checkpoint of step 1" in events[-1]["data"]["error_message"]
        # The worker had loaded step 1 into its engine (its timeline, reported before the
        # commit, says so) ...
        (timeline,) = [e["data"] for e in events if e["type"] == "job_timeline"]
        adapter = lora_name(model["id"], 1)
        loads = [c for c in timeline["engine"] if c["call"] == "load_lora_adapter"]
        assert [c.get("lora_name") for c in loads] == [adapter]
        # ... yet nobody was answered by step 1, before or after the failure ...
        assert served_steps and set(served_steps) == {"0"}
        _, headers = support.sample(client, model["inference_name"], "Say hi.", n=1)
        assert headers["x-skytrain-step"] == "0"
        with pytest.raises(openai.NotFoundError):
            support.sample(client, f"{model['inference_name']}:step1", "Say hi.", n=1)
        # ... and the engine let go of it (the worker unloads it when the commit fails).
        wait_until(
            lambda: adapter not in _engine_adapters(service, model["id"]),
            what="the engine unloading step 1",
        )
