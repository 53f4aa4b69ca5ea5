"""An operator without Tinker training sets SKYTRAIN_WORKER_TINKER_MAX_RUNS=0: workers then
park no Tinker trainers, so the plan asks SkyPilot for no host memory for them (a 7B on an
L4: about 27 GB instead of 60), and creating a Tinker training run is refused with the
reason (nothing stored) instead of waiting for a worker that would never lease it. The
control plane is the real app over HTTP, the official ``tinker`` SDK the client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import tinker
from skytrain_backend.app import create_app
from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.planning import ModelShape, choose_worker_gpu, find_model_config
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread

MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"


def test_no_tinker_runs_asks_for_no_parked_trainers() -> None:
    def asked(runs: int) -> int:
        settings = Settings(storage={"model_cache_dir": MODELS}, worker={"tinker_max_runs": runs})
        choice = choose_worker_gpu(QWEN_7B, ["L4:1"], settings=settings, lora_rank=8)
        assert choice is not None and choice.plan is not None
        assert choice.plan.host_memory_gb is not None
        return choice.plan.host_memory_gb

    none, two = asked(0), asked(2)
    config = find_model_config(QWEN_7B, cache_dir=MODELS)
    assert config is not None
    shape = ModelShape.from_config(config)
    # Each parked run: its bf16 base and rank-8 LoRA states (weights, gradients, Adam).
    parked = shape.parameters() * 2 + shape.lora_parameters(rank=8) * 16
    assert two - none == pytest.approx(2 * parked / 1e9, abs=1)
    assert none <= 30 and two >= 55


def test_creating_a_tinker_training_run_is_refused_when_workers_hold_none(
    make_settings: MakeSettings,
) -> None:
    settings = make_settings(worker={"tinker_max_runs": 0})
    engine = create_db_engine(settings.storage.resolved_database_url)
    with session_factory(engine)() as session:
        _, key = api_keys.create_key(session, tenant_name="acme")
    try:
        with serve_in_thread(create_app(settings)) as url:
            service = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
            with pytest.raises(tinker.BadRequestError) as refused:
                service.create_lora_training_client(base_model="tests/tiny", rank=8).result(
                    timeout=60
                )
            message = str(refused.value)
            assert "SKYTRAIN_WORKER_TINKER_MAX_RUNS is 0" in message, message
            sdk = httpx.Client(base_url=url, headers={"X-API-Key": "tml-" + key}, timeout=60)
            with sdk:
                assert sdk.get("/api/v1/training_runs").json()["training_runs"] == []
            # Sampling through Tinker needs no parked trainer: still accepted.
            service.create_sampling_client(base_model="tests/tiny").result(timeout=60)
            service.close("success").result(timeout=60)
    finally:
        engine.dispose()
