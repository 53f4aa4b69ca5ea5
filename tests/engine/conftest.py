"""Real CPU engines for the engine tests: ``skytrain engine serve`` subprocesses on free ports.

Each engine is started once per test session through the launcher the worker uses
(``EngineProcess``), so every test also exercises start-up, the ``/health`` wait and shutdown.
LoRA adapters are made in the tests with peft (random, non-zero weights, ``save_pretrained``).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import EngineProcess
from skytrain_backend.engine.options import EngineCommand

SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
STARTUP_TIMEOUT_S = 300.0
TINY_MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningEngine:
    name: str
    base_url: str
    process: EngineProcess
    api_key: str | None = None

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
    return RunningEngine(name=name, base_url=base_url, process=process, api_key=api_key)


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


def save_lora_adapter(
    base_model: Path | object,
    directory: Path,
    *,
    seed: int,
    rank: int = 4,
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
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
