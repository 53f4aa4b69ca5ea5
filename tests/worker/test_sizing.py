"""A worker's memory plan on its own GPU (worker.sizing): what vLLM and the trainer start with
when the worker was not told, and that what it was told wins. The GPU is a row of the table
(no CUDA here); the configs are real models' (tests/planning/models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.config import Settings
from skytrain_backend.engine.options import EngineOptions
from skytrain_backend.engine.vllm import vllm_command
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.planning import find_model_config, parse_gpu
from skytrain_backend.worker.sizing import size_worker

MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"


def _config(model: str) -> dict[str, Any]:
    config = find_model_config(model, cache_dir=MODELS)
    assert config is not None
    return config


def _l4() -> Any:
    return parse_gpu("L4").gpu


def test_a_worker_not_told_starts_vllm_and_the_trainer_with_the_plan(tmp_path: Path) -> None:
    settings = Settings(storage={"home": tmp_path})
    sizing = size_worker(settings, base_model=QWEN_7B, config=_config(QWEN_7B), gpu=_l4())
    plan = sizing.plan
    assert plan is not None and plan.fits
    options = EngineOptions.from_settings(settings, model=QWEN_7B, port=8000, **sizing.engine)
    argv = vllm_command(options).argv
    # vLLM refuses a 7B on an L4 at the model's own 32768 tokens with util 0.8: the plan's
    # context and share are passed.
    assert argv[argv.index("--max-model-len") + 1] == str(plan.max_model_len)
    assert 2048 <= plan.max_model_len < 32768
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(plan.gpu_memory_utilization)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert sizing.trainer == {
        "gradient_checkpointing": True,
        "max_row_tokens": plan.max_row_tokens,
        "spread": False,
    }


def test_what_the_worker_was_told_wins_over_the_plan(tmp_path: Path) -> None:
    settings = Settings(
        storage={"home": tmp_path},
        engine={"max_model_len": 4096, "gpu_memory_utilization": 0.85},
        trainer={"gradient_checkpointing": False},
    )
    sizing = size_worker(settings, base_model=QWEN_7B, config=_config(QWEN_7B), gpu=_l4())
    assert sizing.engine["max_model_len"] == 4096
    assert sizing.engine["gpu_memory_utilization"] == 0.85
    assert sizing.engine["tensor_parallel_size"] == 1  # from the plan
    assert sizing.trainer["gradient_checkpointing"] is False
    # The plan was made for the context it was told.
    assert sizing.plan is not None and sizing.plan.max_model_len == 4096


def test_a_model_too_large_for_the_workers_gpu_stops_it_with_the_plans_reason(
    tmp_path: Path,
) -> None:
    config = _config("Qwen/Qwen2.5-32B-Instruct")
    with pytest.raises(ConfigurationError, match="does not fit 1 x L4 for serving") as raised:
        size_worker(
            Settings(storage={"home": tmp_path}), base_model="q32", config=config, gpu=_l4()
        )
    assert raised.value.message.startswith("this worker cannot serve and train q32: ")


def test_without_cuda_or_a_config_the_settings_stand_alone(tmp_path: Path) -> None:
    settings = Settings(storage={"home": tmp_path}, engine={"max_model_len": 1024})
    for sizing in (
        size_worker(settings, base_model=QWEN_7B, config=_config(QWEN_7B), gpu=None),
        size_worker(settings, base_model=QWEN_7B, config=None, gpu=_l4()),
    ):
        assert sizing.plan is None
        assert sizing.engine == {
            "max_model_len": 1024,
            "gpu_memory_utilization": None,
            "tensor_parallel_size": None,
        }
        options = EngineOptions.from_settings(settings, model=QWEN_7B, port=8000, **sizing.engine)
        assert (options.max_model_len, options.gpu_memory_utilization) == (1024, 0.8)
        assert sizing.trainer == {
            "gradient_checkpointing": None,
            "max_row_tokens": None,
            "spread": False,
        }


def test_a_model_no_gpu_of_the_node_holds_for_training_gets_trainer_shards(
    tmp_path: Path,
) -> None:
    """Qwen2.5-32B on two A100-80GB: vLLM over both, and the trainer as 2 torchrun ranks."""
    spec = parse_gpu("A100-80GB:2")
    config = _config("Qwen/Qwen2.5-32B-Instruct")
    sizing = size_worker(
        Settings(storage={"home": tmp_path}),
        base_model="q32",
        config=config,
        gpu=spec.gpu,
        gpu_count=2,
    )
    assert sizing.engine["tensor_parallel_size"] == 2
    assert sizing.trainer_shards == 2
    # Told otherwise, the worker keeps the trainer in its own process.
    told = size_worker(
        Settings(storage={"home": tmp_path}, trainer={"shards": 1}),
        base_model="q32",
        config=config,
        gpu=spec.gpu,
        gpu_count=2,
    )
    assert told.trainer_shards == 1
