"""`skytrain workers plan`, run through Typer's CliRunner on real models' config.json files
(tests/planning/models as the model cache)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import get_settings
from tests.fixtures.hub import LoopbackHub

MODELS = Path(__file__).parent / "models"


@pytest.fixture(autouse=True)
def model_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, loopback_hub: LoopbackHub
) -> Iterator[None]:
    for name in ("SKYTRAIN_SKYPILOT_ACCELERATORS", "SKYTRAIN_ENGINE_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKYTRAIN_HOME", str(tmp_path))
    monkeypatch.setenv("SKYTRAIN_MODEL_CACHE_DIR", str(MODELS))
    # A model the cache lacks is asked of the Hub: the loopback one, never the real one.
    monkeypatch.setenv("HF_ENDPOINT", loopback_hub.url)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _plan(*args: str) -> Any:
    result = CliRunner().invoke(app, ["workers", "plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("gpu", ["L4:1", "A10G:1"])
def test_qwen_7b_fits_a_24_gb_gpu(gpu: str) -> None:
    plan = _plan("Qwen/Qwen2.5-7B-Instruct", "--gpu", gpu)
    assert plan["fits"] is True, plan["reason"]
    assert 2048 <= plan["max_model_len"] <= 32768
    assert plan["host_memory_gb"] > 0
    assert plan["tensor_parallel_size"] == 1
    assert 0 < plan["gpu_memory_utilization"] <= 0.92
    assert plan["gradient_checkpointing"] is True


def test_qwen_32b_does_not_fit_an_l4_and_says_why() -> None:
    plan = _plan("Qwen/Qwen2.5-32B-Instruct", "--gpu", "L4:1")
    assert plan["fits"] is False
    assert "weights 61.03 GiB" in plan["reason"] and "more than vLLM's" in plan["reason"]


def test_qwen_72b_does_not_fit_one_h100_and_fits_a_node_of_eight() -> None:
    one, node = _plan("Qwen/Qwen2.5-72B-Instruct", "--gpu", "H100:1", "--gpu", "H100:8")
    assert one["fits"] is False and "does not fit 1 x H100" in one["reason"]
    assert node["fits"] is True and node["tensor_parallel_size"] > 1
    assert node["trainer_shards"] > 1
    assert "weights 135.43 GiB" in one["reason"] and "more than vLLM's" in one["reason"]


def test_qwen_32b_on_two_a100s_uses_both() -> None:
    plan = _plan("Qwen/Qwen2.5-32B-Instruct", "--gpu", "A100-80GB:2")
    assert plan["fits"] is True and plan["tensor_parallel_size"] == 2
    assert plan["trainer_shards"] == 2 and plan["trainer_device_map"] == "fsdp"


def test_options_change_the_plan() -> None:
    wide = _plan("Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1", "--context", "4096")
    narrow = _plan(
        "Qwen/Qwen2.5-7B-Instruct",
        "--gpu",
        "L4:1",
        "--context",
        "4096",
        "--lora-rank",
        "8",
        "--max-loras",
        "1",
        "--row-tokens",
        "2048",
    )
    assert wide["max_model_len"] == narrow["max_model_len"] == 4096
    # Smaller LoRA slots leave more KV cache.
    assert narrow["kv_cache_tokens"] > wide["kv_cache_tokens"]
    assert narrow["max_row_tokens"] == 2048


def test_without_gpu_it_plans_the_configured_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYTRAIN_SKYPILOT_ACCELERATORS", "L4:1, H100:1")
    get_settings.cache_clear()
    plans = _plan("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert [plan["gpu"] for plan in plans] == ["L4:1", "H100:1"]


def test_without_gpu_or_configuration_it_plans_every_gpu_it_knows() -> None:
    plans = _plan("Qwen/Qwen2.5-72B-Instruct")
    fits = {plan["gpu"]: plan["fits"] for plan in plans}
    assert fits == {
        "L4:1": False,
        "A10G:1": False,
        "L40S:1": False,
        "A100:1": False,
        "A100-80GB:1": False,
        "H100:1": False,
        "H200:1": False,
        "B200:1": True,
    }


def test_the_table_shows_the_verdict_and_the_arithmetic() -> None:
    result = CliRunner().invoke(
        app, ["workers", "plan", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1"]
    )
    assert result.exit_code == 0, result.output
    assert "Qwen/Qwen2.5-7B-Instruct on L4:1: fits" in result.output
    for item in ("weights", "LoRA slots", "KV cache", "LoRA states", "longest row", "memory"):
        assert item in result.output
    assert "14.19 GiB" in result.output and "--max-model-len" in result.output


def test_an_unknown_model_or_gpu_is_an_error_saying_what_to_do() -> None:
    runner = CliRunner()
    missing = runner.invoke(app, ["workers", "plan", "nobody/no-such-model", "--gpu", "L4:1"])
    assert missing.exit_code == 1
    assert "base model nobody/no-such-model is not on the Hugging Face Hub" in missing.output
    assert "check the model id" in missing.output
    unknown = runner.invoke(
        app, ["workers", "plan", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "MI300X:1"]
    )
    assert unknown.exit_code == 1
    assert "unknown GPU MI300X:1: skytrain knows L4, A10G" in unknown.output
    malformed = runner.invoke(app, ["workers", "plan", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:0"])
    assert malformed.exit_code == 1 and "1 to 16" in malformed.output


def test_the_models_rank_is_planned_not_the_largest_a_worker_loads() -> None:
    """At rank 64 (SKYTRAIN_ENGINE_MAX_LORA_RANK's default) an L4 refuses Llama-3.1-8B and
    cuts a 7B's training rows to 1,536 tokens; at rank 8, models' default, both train
    rows of 4,096 tokens and more."""
    llama = "meta-llama/Llama-3.1-8B-Instruct"
    assert _plan(llama, "--gpu", "L4:1")["fits"] is False
    at_8 = _plan(llama, "--gpu", "L4:1", "--lora-rank", "8")
    assert at_8["fits"] is True, at_8["reason"]
    assert at_8["max_row_tokens"] >= 4096
    qwen = _plan("Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1", "--lora-rank", "8")
    assert qwen["max_row_tokens"] >= 4096
    assert (
        qwen["max_row_tokens"]
        > _plan("Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1")["max_row_tokens"]
    )
    rows = {row["item"]: row["how"] for row in qwen["rows"]}
    assert "x rank 8 (--max-lora-rank)" in rows["LoRA slots"]
    assert "(rank 8)" in rows["LoRA states"]


def test_a_rank_above_what_workers_load_is_refused() -> None:
    result = CliRunner().invoke(
        app, ["workers", "plan", "Qwen/Qwen2.5-7B-Instruct", "--lora-rank", "128"]
    )
    assert result.exit_code == 2
    # Click's error box wraps the message: read it as one line.
    message = " ".join(result.output.replace("│", " ").split())
    assert "128 is above SKYTRAIN_ENGINE_MAX_LORA_RANK (64), the largest rank a worker" in message


def test_a_mixture_of_experts_is_refused_on_every_gpu_with_the_reason() -> None:
    one, node = _plan("Qwen/Qwen3-30B-A3B", "--gpu", "H100:1", "--gpu", "H100:8")
    for plan in (one, node):
        assert plan["fits"] is False
        assert "Qwen/Qwen3-30B-A3B is a mixture of experts (128 experts a layer)" in plan["reason"]
        assert "Choose a dense base model" in plan["reason"]
    table = CliRunner().invoke(app, ["workers", "plan", "Qwen/Qwen3-30B-A3B", "--gpu", "H100:8"])
    assert table.exit_code == 0, table.output
    assert "Qwen/Qwen3-30B-A3B on H100:8: does not fit" in table.output


def test_nodes_plan_a_model_no_node_holds() -> None:
    """Qwen2.5-72B on A100-40GB: one node of 4 cannot serve it; with --nodes 2 it fits, vLLM
    in 2 pipeline stages and the trainer over all 8 GPUs."""
    one = _plan("Qwen/Qwen2.5-72B-Instruct", "--gpu", "A100:4", "--lora-rank", "8")
    assert not one["fits"]
    two = _plan("Qwen/Qwen2.5-72B-Instruct", "--gpu", "A100:4", "--lora-rank", "8", "--nodes", "2")
    assert two["fits"] and two["nodes"] == 2 and two["trainer_shards"] == 8
    result = CliRunner().invoke(
        app,
        [
            *("workers", "plan", "Qwen/Qwen2.5-72B-Instruct"),
            *("--gpu", "A100:4", "--nodes", "2", "--lora-rank", "8"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "on 2 nodes of A100:4: fits" in result.output
    assert "--pipeline-parallel-size 2" in result.output
