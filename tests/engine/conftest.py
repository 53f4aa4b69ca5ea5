"""Real engines for the engine tests: ``skytrain engine serve`` (the CPU engine) and, under
``-m vllm``, real vLLM (its CPU build, from the environment scripts/test-vllm.sh makes), each a
subprocess on a free port.

Each engine is started once per test session through the launcher the worker uses
(``EngineProcess``), so every test also exercises start-up, the ``/health`` wait and shutdown.
LoRA adapters are made in the tests with peft (random, non-zero weights, ``save_pretrained``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from skytrain_backend.config import get_settings
from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import EngineProcess
from skytrain_backend.engine.options import EngineCommand, EngineOptions
from skytrain_backend.protocol import DEFAULT_LORA_TARGET_MODULES
from tests.fixtures.ports import free_port

SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
STARTUP_TIMEOUT_S = 300.0
TINY_MAX_MODEL_LEN = 512
# vLLM's CPU build loads SmolLM2 in about 2 minutes on 2 cores; more when the machine is busy.
VLLM_STARTUP_TIMEOUT_S = 900.0
VLLM_MAX_MODEL_LEN = 1024
VLLM_API_KEY = "vllm-test-key"


def sampled_ids(choice: Any) -> list[int]:
    """The token ids of an OpenAI choice asked for with ``return_tokens_as_token_ids`` (its
    tokens come back as ``"token_id:<id>"``)."""
    return [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]


@dataclass
class RunningEngine:
    name: str
    base_url: str
    process: EngineProcess
    api_key: str | None = None
    # "cpu" (skytrain's engine) or "vllm"; the model it serves and its context length.
    kind: str = "cpu"
    model_path: Path | None = None
    max_model_len: int | None = None

    def openai(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or self.api_key or "no-key",
            max_retries=0,
            timeout=600,
        )

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "no-key",
            max_retries=0,
            timeout=600,
        )

    def client(self) -> EngineClient:
        return EngineClient(self.base_url, api_key=self.api_key)


def start_engine(
    model: Path, name: str, log_dir: Path, *extra: str, api_key: str | None = None
) -> RunningEngine:
    port = free_port()
    argv = [SKYTRAIN, "engine", "serve", "--engine", "hf", "--model", str(model)]
    argv += ["--served-model-name", name, "--port", str(port), "--threads", "1"]
    argv += ["--log-level", "warning", *extra]
    if api_key:
        argv += ["--api-key", api_key]
    base_url = f"http://127.0.0.1:{port}"
    process = EngineProcess(
        EngineCommand(argv=argv), base_url=base_url, log_path=log_dir / f"{name}-{port}.log"
    )
    process.start()
    try:
        asyncio.run(process.wait_until_healthy(STARTUP_TIMEOUT_S))
    except BaseException:
        process.stop()
        raise
    max_model_len = (
        int(extra[extra.index("--max-model-len") + 1]) if "--max-model-len" in extra else None
    )
    return RunningEngine(
        name=name,
        base_url=base_url,
        process=process,
        api_key=api_key,
        model_path=model,
        max_model_len=max_model_len,
    )


@pytest.fixture(scope="session")
def tiny_engine(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngine]:
    """The tiny random model, with a short context so limits are cheap to reach."""
    engine = start_engine(
        tiny_model_path,
        "tiny",
        tmp_path_factory.mktemp("engine-logs"),
        "--max-model-len",
        str(TINY_MAX_MODEL_LEN),
    )
    yield engine
    engine.process.stop()


@pytest.fixture(scope="session")
def smollm2_engine(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngine]:
    engine = start_engine(smollm2_path, "smollm2", tmp_path_factory.mktemp("engine-logs"))
    yield engine
    engine.process.stop()


def vllm_python() -> str:
    """The interpreter with vLLM: $SKYTRAIN_VLLM_PYTHON (scripts/test-vllm.sh sets it) or this."""
    python = get_settings().engine.vllm_python
    if python:
        return python
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "the vllm tests need vLLM: run them with scripts/test-vllm.sh (it builds vLLM's CPU "
            "environment), or set SKYTRAIN_VLLM_PYTHON to a Python that has vllm"
        )
    return sys.executable


def start_vllm(model: Path, name: str, log_dir: Path) -> RunningEngine:
    """Real vLLM serving ``model``, started as the worker starts it (the launcher's command,
    with the key in the environment, runtime LoRA, hermes tool calls, sleep mode where the
    platform has it)."""
    options = EngineOptions(
        model=str(model),
        served_model_name=name,
        port=free_port(),
        api_key=VLLM_API_KEY,
        max_model_len=VLLM_MAX_MODEL_LEN,
        max_loras=4,
        max_lora_rank=8,
        vllm_python=vllm_python(),
    )
    process = EngineProcess.for_engine(
        options,
        kind="vllm",
        log_path=log_dir / f"vllm-{name}.log",
        startup_timeout_s=VLLM_STARTUP_TIMEOUT_S,
    )
    try:
        asyncio.run(process.launch())
    except BaseException:
        print(process.log_tail(80), file=sys.stderr)
        raise
    return RunningEngine(
        name=name,
        base_url=options.base_url,
        process=process,
        api_key=VLLM_API_KEY,
        kind="vllm",
        model_path=model,
        max_model_len=VLLM_MAX_MODEL_LEN,
    )


@pytest.fixture(scope="session")
def vllm_engine(
    smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngine]:
    """vLLM serving SmolLM2 (its CPU attention takes head size 64; the tiny model's 16 it
    does not)."""
    engine = start_vllm(smollm2_path, "smollm2", tmp_path_factory.mktemp("vllm-logs"))
    yield engine
    engine.process.stop()


def save_lora_adapter(
    base_model: Path | object,
    directory: Path,
    *,
    seed: int,
    rank: int = 4,
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES,
    no_op: bool = False,
) -> Path:
    """A peft LoRA adapter for ``base_model`` (a directory or a model object), saved to disk.

    With ``no_op`` the B matrices are zero (peft's default), so the adapter changes nothing;
    otherwise every matrix is random and the adapter visibly changes the model's outputs.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = (
        AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        if isinstance(base_model, Path)
        else base_model
    )
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(target_modules),
        init_lora_weights=no_op,
    )
    get_peft_model(model, config).save_pretrained(directory)
    return directory


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., Path]:
    """``make_adapter(base_model_dir, seed=...)`` -> a fresh adapter directory."""
    counter = iter(range(1_000))

    def make(base_model: Path, **kwargs: object) -> Path:
        return save_lora_adapter(base_model, tmp_path / f"adapter-{next(counter)}", **kwargs)  # type: ignore[arg-type]

    return make
