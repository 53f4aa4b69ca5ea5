"""What an engine process is started with, whichever engine it is."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from skytrain_backend.errors import ConfigurationError

if TYPE_CHECKING:
    from skytrain_backend.config import EngineKind, Settings

ResolvedEngine = Literal["vllm", "hf"]


@dataclass(frozen=True)
class EngineOptions:
    """One engine serving one base model; the vLLM-only fields are ignored by the CPU engine."""

    model: str
    # Name the base model is served under; default: ``model`` as given.
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    # CPU engine: torch threads (default: half the cores).
    threads: int | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1
    # Nodes the model is split across by layers (a multi-node worker: vLLM over Ray).
    pipeline_parallel_size: int = 1
    # The interpreter that runs vLLM (one with vllm installed); None: this one.
    vllm_python: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    @property
    def listen_args(self) -> list[str]:
        """The flags both engines' servers take for their name and address."""
        return ["--served-model-name", self.name, "--host", self.host, "--port", str(self.port)]

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_settings(
        cls, settings: Settings, *, model: str, port: int, **overrides: object
    ) -> EngineOptions:
        """Options for ``model`` with the engine settings (``SKYTRAIN_ENGINE_*``) applied.

        A setting or override of None means "not given": the default stays; overrides win.
        """
        values: dict[str, object] = {
            "max_loras": settings.engine.max_loras,
            "max_lora_rank": settings.engine.max_lora_rank,
            "gpu_memory_utilization": settings.engine.gpu_memory_utilization,
            "tensor_parallel_size": settings.engine.tensor_parallel_size,
            "pipeline_parallel_size": settings.engine.pipeline_parallel_size,
            "max_model_len": settings.engine.max_model_len,
            "vllm_python": settings.engine.vllm_python,
        }
        values.update({key: value for key, value in overrides.items() if value is not None})
        given = {key: value for key, value in values.items() if value is not None}
        return cls(model=model, port=port, **given)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EngineCommand:
    """A process to start: argv and the environment variables it needs on top of ours."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # Whether /sleep gives the engine's memory back (vLLM only where its platform has sleep
    # mode); where it does not, the sleep routes still answer.
    sleep_frees_memory: bool = True


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def select_engine(kind: EngineKind | str, *, vllm_python: str | None = None) -> ResolvedEngine:
    """``auto`` is vLLM when CUDA and vllm are both present, the CPU engine otherwise.

    With ``vllm_python`` (an interpreter of its own that has vllm) vLLM counts as present.
    """
    has_vllm = vllm_python is not None or importlib.util.find_spec("vllm") is not None
    if kind == "hf":
        return "hf"
    if kind == "vllm":
        if not has_vllm:
            raise ConfigurationError(
                "engine 'vllm' was asked for but vllm is not installed: run the worker in "
                "the vLLM image (vllm/vllm-openai:v0.34.0, as sky/worker.yaml and "
                "infra/Dockerfile.worker do), or use engine 'hf' (or 'auto')"
            )
        return "vllm"
    if kind != "auto":
        raise ConfigurationError(f"unknown engine {kind!r}: use auto, vllm or hf")
    return "vllm" if has_vllm and cuda_available() else "hf"
