"""`skytrain workers plan` on a fresh install: no model cache, no Hugging Face cache, so a Hub
id's config.json comes from the Hub (HF_ENDPOINT pointed at the loopback Hub of
tests/fixtures/hub.py, which serves the real models' files), with the operator's HF_TOKEN.
"""

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

CONFIG_ONLY = "/resolve/main/config.json"


@pytest.fixture(autouse=True)
def fresh_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for name in (
        "SKYTRAIN_SKYPILOT_ACCELERATORS",
        "SKYTRAIN_ENGINE_MAX_MODEL_LEN",
        "SKYTRAIN_MODEL_CACHE_DIR",
        "SKYTRAIN_HF_TOKEN",
        "HF_TOKEN",
        "SKYTRAIN_HF_ENDPOINT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKYTRAIN_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _run(hub: str, *args: str, token: str | None = None) -> Any:
    env = {"HF_ENDPOINT": hub, **({"HF_TOKEN": token} if token else {})}
    get_settings.cache_clear()
    return CliRunner().invoke(app, ["workers", "plan", *args], env=env)


def _plan(hub: str, *args: str, token: str | None = None) -> Any:
    result = _run(hub, *args, "--json", token=token)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_hub_id_is_planned_from_the_hubs_config(loopback_hub: LoopbackHub) -> None:
    small = _plan(loopback_hub.url, "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1")
    assert small["fits"] is True, small["reason"]
    large = _plan(loopback_hub.url, "Qwen/Qwen2.5-32B-Instruct", "--gpu", "L4:1")
    assert large["fits"] is False
    assert "weights 61.03 GiB" in large["reason"]
    # That one file, nothing else of the repositories.
    assert {path for _, path in loopback_hub.requests} == {
        f"/Qwen/Qwen2.5-7B-Instruct{CONFIG_ONLY}",
        f"/Qwen/Qwen2.5-32B-Instruct{CONFIG_ONLY}",
    }


def test_a_gated_model_is_planned_with_the_operators_token(loopback_hub: LoopbackHub) -> None:
    refused = _run(loopback_hub.url, "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4:1")
    assert refused.exit_code != 0
    (error,) = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert "meta-llama/Llama-3.1-8B-Instruct is gated" in error and "HF_TOKEN" in error
    assert loopback_hub.url.split("//")[1] not in error  # not the Hub's address
    plan = _plan(
        loopback_hub.url,
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "L4:1",
        token="hf_llama_token",
    )
    assert plan["gpu"] == "L4:1" and plan["model"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_fresh_install_fits_llama_8b_on_an_l4_at_rank_8_from_the_hubs_config(
    loopback_hub: LoopbackHub,
) -> None:
    """Issue 34's must-show, on empty caches: at workers' largest rank (64) an L4 refuses
    Llama-3.1-8B; at rank 8, models' default, it fits with rows of at least 4,096 tokens."""
    llama = ("meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4:1")
    at_64 = _plan(loopback_hub.url, *llama, token="hf_llama_token")
    assert at_64["fits"] is False
    at_8 = _plan(loopback_hub.url, *llama, "--lora-rank", "8", token="hf_llama_token")
    assert at_8["fits"] is True, at_8["reason"]
    assert at_8["max_row_tokens"] >= 4096
    assert {path for _, path in loopback_hub.requests} == {
        f"/meta-llama/Llama-3.1-8B-Instruct{CONFIG_ONLY}"
    }


def test_a_model_the_hub_does_not_have_is_named_with_what_to_check(
    loopback_hub: LoopbackHub,
) -> None:
    result = _run(loopback_hub.url, "nobody/no-such-model", "--gpu", "L4:1")
    assert result.exit_code != 0
    assert "base model nobody/no-such-model is not on the Hugging Face Hub" in result.output
    assert "check the model id" in result.output


def test_an_unreachable_hub_is_said_plainly(unreachable_hub: str) -> None:
    result = _run(unreachable_hub, "Qwen/Qwen2.5-7B-Instruct", "--gpu", "L4:1")
    assert result.exit_code != 0
    (error,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "could not be reached for base model Qwen/Qwen2.5-7B-Instruct" in error
    assert "HF_ENDPOINT" in error and unreachable_hub.split("//")[1] not in error
