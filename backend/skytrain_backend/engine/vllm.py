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
"""

from __future__ import annotations

import sys

from skytrain_backend.engine.options import EngineCommand, EngineOptions
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.hub import resolve_model

# The values vLLM's --max-lora-rank accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest rank vLLM accepts that holds adapters of ``rank``."""
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise ConfigurationError(f"LoRA rank {rank} is above vLLM's largest ({LORA_RANKS[-1]})")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def vllm_command(options: EngineOptions) -> EngineCommand:
    if options.host not in LOOPBACK_HOSTS:
        raise ConfigurationError(
            f"vLLM would listen on {options.host}, but its dev-mode routes (sleep, "
            "collective_rpc, weight updates) are open to anyone who reaches it: it listens on "
            "127.0.0.1 only. Reach it from outside through `skytrain worker`'s front door"
        )
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        resolve_model(options.model),
        "--served-model-name",
        options.name,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--enable-lora",
        "--max-lora-rank",
        str(lora_rank_slot(options.max_lora_rank)),
        "--max-loras",
        str(options.max_loras),
        "--enable-sleep-mode",
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
    if options.max_model_len is not None:
        argv += ["--max-model-len", str(options.max_model_len)]
    if options.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    argv += list(options.extra_args)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    if options.api_key:
        env["VLLM_API_KEY"] = options.api_key
    return EngineCommand(argv=argv, env=env)
