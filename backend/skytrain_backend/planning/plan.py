"""The memory plan of one worker: a base model on ``GPU:N``, served by vLLM and trained on.

A worker's GPU holds one of two phases at a time, never both: vLLM serving, or the trainer
while vLLM sleeps (level 1: its weights move to pinned host memory and its KV cache is
dropped; wake-up copies them back). The plan checks each phase against the GPU and sizes
what the phases leave free:

- **serving** (per GPU, over ``tensor_parallel_size`` GPUs): vLLM takes
  ``gpu_memory_utilization`` of the GPU; out of it go the weights, the LoRA slots
  (``max_loras`` adapters at vLLM's ``--max-lora-rank`` for every linear layer), and what vLLM
  measures at start-up beside them: memory outside torch (CUDA context, cuBLAS, NCCL), the
  peak of its profiling forward pass (``max_num_batched_tokens`` tokens, ``max_num_seqs``
  sampled logits) and its CUDA graphs. The rest is KV cache (``kv_cache_tokens`` tokens);
  ``max_model_len`` is the wanted context if it holds ``CONCURRENT_SEQUENCES`` sequences of
  it, else the longest context that does (vLLM itself only requires one, and refuses to start
  otherwise). ``tensor_parallel_size`` is the largest power of two of the node's GPUs that
  splits the model's heads evenly: the worker asked for them, vLLM uses them (more KV cache).
- **training** (vLLM asleep): what vLLM keeps while asleep (memory outside torch, CUDA
  graphs) and the trainer's own CUDA context, then the bf16 base weights, the LoRA weights,
  gradients and Adam's two moments (fp32, 16 bytes a parameter) and the activations of the
  longest row (``shapes.activation_bytes``). Gradient checkpointing is on when the wanted
  row does not fit without it; ``max_row_tokens`` is the longest row that fits. A trainer
  that fits one GPU is loaded straight onto it; one that does not runs as ``trainer_shards``
  processes (torchrun, one a GPU), the frozen base sharded over them with FSDP2: each GPU
  holds its share of the weights, the two layers being gathered at a time, the whole LoRA
  states, and the activations of its own rows (``trainer.distributed``), over all the
  node's GPUs.

Host memory and disk are ``host``'s: vLLM's pinned weights during training, the Tinker runs'
trainers parked between operations, the processes' own; the checkpoint and the image. Every figure is a row of
``rows`` an operator can check by hand. Pure arithmetic: no torch, no files. A mixture of
experts is refused with ``experts.refusal``'s reason, on every GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from skytrain_backend.errors import ConfigurationError
from skytrain_backend.planning import experts
from skytrain_backend.planning.gpus import GIB, GpuType, gib
from skytrain_backend.planning.host import host_needs
from skytrain_backend.planning.shapes import SERVE_DTYPE_BYTES, ModelShape, activation_bytes

# The values vLLM's --max-lora-rank accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# The share of each GPU vLLM gets (vLLM's own default is 0.9); less on a GPU too small to
# leave RESERVED_GIB beside it.
MAX_GPU_MEMORY_UTILIZATION = 0.92
# What must fit in the rest, outside vLLM's share, while it serves: the worker's own CUDA
# context (it imports the trainer) and what its allocator keeps. vLLM refuses to start
# unless its share is free, so the worker checks that before starting it (worker.sizing).
RESERVED_GIB = 1.0
# Measured by vLLM at start-up beside weights and KV cache (its logs: "non_torch_memory",
# "PyTorch activation peak memory", CUDA graphs); NCCL adds buffers on more than one GPU.
NON_TORCH_GIB = 0.75
NCCL_GIB = 0.5
CUDA_GRAPHS_GIB = 0.5
# The trainer process's own CUDA context, and room the caching allocator cannot use
# (fragmentation, cuBLAS workspaces), as a share of the GPU.
TRAINER_CONTEXT_GIB = 0.5
ALLOCATOR_SLACK = 0.05
# LoRA weights, gradients and Adam's two moments, fp32 each.
LORA_TRAINING_BYTES_PER_PARAMETER = 4 + 4 + 8
# Sequences of the full context the KV cache should hold at once for rollouts to batch.
CONCURRENT_SEQUENCES = 4
# Contexts the plan chooses are multiples of this; below MIN_CONTEXT, a worker is of no use.
CONTEXT_STEP = 1024
MIN_CONTEXT = 2048
DEFAULT_CONTEXT = 32768
# Training rows the plan chooses are multiples of this; below MIN_ROW_TOKENS it refuses.
ROW_STEP = 256
MIN_ROW_TOKENS = 1024
LOGPROB_CHUNK_SIZE = 1024
SLEEP_LEVEL = 1


def lora_rank_slot(rank: int) -> int:
    """The smallest rank vLLM accepts that holds adapters of ``rank``."""
    for slot in LORA_RANKS:
        if slot >= rank:
            return slot
    raise ConfigurationError(f"LoRA rank {rank} is above vLLM's largest ({LORA_RANKS[-1]})")


def vllm_batch_defaults(gpu: GpuType) -> tuple[int, int]:
    """vLLM's OpenAI server defaults (max_num_batched_tokens, max_num_seqs) on this GPU
    (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``)."""
    if gpu.memory_bytes >= 160 * GIB:
        return 16384, 1024
    if gpu.memory_bytes >= 70 * GIB and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


def gpu_memory_utilization(gpu: GpuType) -> float:
    share = 1 - RESERVED_GIB * GIB / gpu.memory_bytes
    return min(MAX_GPU_MEMORY_UTILIZATION, math.floor(share * 100) / 100)


@dataclass(frozen=True)
class PlanRow:
    """One line of the arithmetic: what, how much (GiB, or a count), and how it is counted."""

    phase: str
    item: str
    value: str
    how: str


@dataclass(frozen=True)
class WorkerPlan:
    """What a worker for ``model`` on ``gpu`` runs with; see the module docstring."""

    model: str
    gpu: str
    fits: bool
    reason: str
    max_model_len: int | None
    gpu_memory_utilization: float
    kv_cache_tokens: int
    tensor_parallel_size: int
    sleep_level: int
    trainer_dtype: str
    # "cuda:0": the whole trainer on the first GPU; "fsdp": one process a GPU, each on its
    # own (trainer_shards of them); "auto" (a setting only): spread over the node's GPUs.
    trainer_device_map: str
    # Trainer processes (torchrun ranks), the base weights sharded over them.
    trainer_shards: int
    gradient_checkpointing: bool
    max_row_tokens: int | None
    # None when it does not fit.
    host_memory_gb: int | None
    disk_gb: int | None
    rows: list[PlanRow] = field(default_factory=list)
    # Nodes of ``gpu`` (a SkyPilot task's num_nodes): vLLM's pipeline stages, one a node, and
    # the trainer's ranks over every GPU of every node.
    nodes: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def worker_envs(self) -> dict[str, str]:
        """The settings a worker started for this plan gets (``SKYTRAIN_*``)."""
        envs = {
            "SKYTRAIN_ENGINE_GPU_MEMORY_UTILIZATION": str(self.gpu_memory_utilization),
            "SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE": str(self.tensor_parallel_size),
            "SKYTRAIN_TRAINER_GRADIENT_CHECKPOINTING": str(self.gradient_checkpointing).lower(),
            "SKYTRAIN_TRAINER_DEVICE_MAP": self.trainer_device_map,
            "SKYTRAIN_TRAINER_SHARDS": str(self.trainer_shards),
        }
        if self.nodes > 1:
            envs["SKYTRAIN_ENGINE_PIPELINE_PARALLEL_SIZE"] = str(self.nodes)
        if self.max_model_len is not None:
            envs["SKYTRAIN_ENGINE_MAX_MODEL_LEN"] = str(self.max_model_len)
        if self.max_row_tokens is not None:
            envs["SKYTRAIN_TRAINER_MAX_ROW_TOKENS"] = str(self.max_row_tokens)
        return envs


@dataclass(frozen=True)
class _Serving:
    tp: int
    budget: float
    weights: int
    lora: int
    overhead: float
    kv_per_token: int

    @property
    def kv_bytes(self) -> float:
        return self.budget - self.weights - self.lora - self.overhead

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_bytes // self.kv_per_token))


def _serving(
    shape: ModelShape,
    gpu: GpuType,
    *,
    tp: int,
    util: float,
    rank_slot: int,
    max_loras: int,
    stages: int = 1,
) -> _Serving:
    """vLLM on one GPU of ``tp`` (tensor parallel) in each of ``stages`` pipeline stages (one
    a node): a stage holds its share of the layers, counted as the largest, and the
    embeddings and output layer (which only the first and last hold: counted on each)."""
    batched_tokens, max_seqs = vllm_batch_defaults(gpu)
    forward_peak = batched_tokens * (3 * shape.mlp_width // tp + 4 * shape.hidden_size) * 2
    sampler_peak = max_seqs * shape.vocab_size * 4 * 2
    overhead = (
        (NON_TORCH_GIB + (NCCL_GIB if tp * stages > 1 else 0) + CUDA_GRAPHS_GIB) * GIB
        + forward_peak
        + sampler_peak
    )
    layers = max(shape.num_layers, 1)
    stage_layers = math.ceil(layers / stages)
    layer_weights = shape.num_layers * shape.layer_parameters(tp=tp)
    weights = shape.parameters(tp=tp) - layer_weights + stage_layers * (layer_weights // layers)
    slot = shape.lora_slot_parameters(rank=rank_slot, tp=tp)
    return _Serving(
        tp=tp,
        budget=gpu.memory_bytes * util,
        weights=weights * SERVE_DTYPE_BYTES,
        lora=max_loras * math.ceil(slot * stage_layers / layers) * SERVE_DTYPE_BYTES,
        overhead=overhead,
        kv_per_token=math.ceil(shape.kv_cache_bytes_per_token(tp=tp) * stage_layers / layers),
    )


def _tensor_parallel_sizes(shape: ModelShape, count: int) -> list[int]:
    sizes, tp = [], 1
    while tp <= count:
        if shape.splits_over(tp):
            sizes.append(tp)
        tp *= 2
    return sizes


def plan_worker(
    shape: ModelShape,
    gpu: GpuType,
    *,
    model: str,
    gpu_count: int = 1,
    lora_rank: int = 64,
    max_loras: int = 4,
    context: int | None = None,
    row_tokens: int | None = None,
    lora_modules: tuple[str, ...] | None = None,
    tinker_runs: int = 2,
    nodes: int = 1,
) -> WorkerPlan:
    """The plan for ``model`` (of ``shape``) on ``gpu_count`` GPUs of type ``gpu`` (on each of
    ``nodes`` nodes: vLLM's pipeline stages across them, the trainer sharded over them all).

    ``lora_rank`` is the largest rank served and trained, ``max_loras`` the adapters vLLM
    holds at once; ``context`` the wanted ``max_model_len`` (default: the model's own, at
    most ``DEFAULT_CONTEXT``); ``row_tokens`` the longest training row wanted (default: the
    context); ``lora_modules`` the layers trained adapters target (default: all);
    ``tinker_runs`` the Tinker runs whose trainers wait in host memory at once
    (``SKYTRAIN_WORKER_TINKER_MAX_RUNS``).
    """
    return _Planner(
        shape,
        gpu,
        model=model,
        gpu_count=gpu_count,
        lora_rank=lora_rank,
        max_loras=max_loras,
        context=context,
        row_tokens=row_tokens,
        lora_modules=lora_modules,
        tinker_runs=tinker_runs,
        nodes=nodes,
    ).plan()


class _Planner:
    def __init__(
        self,
        shape: ModelShape,
        gpu: GpuType,
        *,
        model: str,
        gpu_count: int,
        lora_rank: int,
        max_loras: int,
        context: int | None,
        row_tokens: int | None,
        lora_modules: tuple[str, ...] | None,
        tinker_runs: int,
        nodes: int = 1,
    ) -> None:
        self.shape, self.gpu, self.model, self.count = shape, gpu, model, gpu_count
        self.nodes = nodes
        self.where = (
            f"{nodes} nodes of {gpu_count} x {gpu.name}"
            if nodes > 1
            else f"{gpu_count} x {gpu.name}"
        )
        self.tinker_runs = tinker_runs
        self.rank_slot = lora_rank_slot(lora_rank)
        self.lora_rank, self.max_loras = lora_rank, max_loras
        self.context, self.row_tokens, self.lora_modules = context, row_tokens, lora_modules
        self.util = gpu_memory_utilization(gpu)
        self.model_context = shape.max_position_embeddings or DEFAULT_CONTEXT
        self.wanted_context = context or min(self.model_context, DEFAULT_CONTEXT)
        self.rows: list[PlanRow] = []

    def row(self, phase: str, item: str, value: str, how: str) -> None:
        self.rows.append(PlanRow(phase, item, value, how))

    def plan(self) -> WorkerPlan:
        shape, gpu = self.shape, self.gpu
        self.row(
            "gpu",
            f"{gpu.name} x {self.count}" + (f" x {self.nodes} nodes" if self.nodes > 1 else ""),
            gib(gpu.memory_bytes),
            f"each, as CUDA reports it (nvidia-smi: {gpu.smi_memory_mib} MiB)",
        )
        self.row(
            "model",
            "parameters",
            f"{shape.parameters() / 1e9:.2f} B",
            f"{shape.num_layers} layers, hidden {shape.hidden_size}, MLP {shape.mlp_width}, "
            f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV heads of "
            f"{shape.head_dim}, vocabulary {shape.vocab_size}"
            + (", tied embeddings" if shape.tied_embeddings else ""),
        )
        if shape.num_experts:
            return self.refuse(None, experts.refusal(self.model, shape.num_experts))
        if self.context is not None and self.context > self.model_context:
            return self.refuse(
                None,
                f"a context of {self.context} tokens is beyond {self.model}'s own "
                f"{self.model_context} (max_position_embeddings): ask for less",
            )
        sizes = _tensor_parallel_sizes(shape, self.count)
        options = [
            _serving(
                shape,
                gpu,
                tp=tp,
                util=self.util,
                rank_slot=self.rank_slot,
                max_loras=self.max_loras,
                stages=self.nodes,
            )
            for tp in sizes
        ]
        serving = self.choose_serving(options)
        self.serving_rows(serving)
        max_model_len, problem = self.context_for(serving)
        if problem is not None:
            return self.refuse(serving, problem)
        assert max_model_len is not None
        return self.plan_training(serving, max_model_len)

    def choose_serving(self, options: list[_Serving]) -> _Serving:
        """The split with the most KV cache: the widest (a GPU of the node left out of
        serving would only idle)."""
        return max(options, key=lambda option: (option.kv_tokens, option.tp))

    def serving_rows(self, s: _Serving) -> None:
        shape = self.shape
        per = f" / {s.tp} GPUs" if s.tp > 1 else ""
        if self.nodes > 1:
            per += f", the largest of {self.nodes} pipeline stages (one a node)"
        batched, seqs = vllm_batch_defaults(self.gpu)
        self.row(
            "serve",
            "vLLM's share",
            gib(s.budget),
            f"gpu_memory_utilization {self.util} x {gib(self.gpu.memory_bytes)}",
        )
        self.row(
            "serve",
            "outside vLLM",
            gib(self.gpu.memory_bytes * (1 - self.util)),
            f"the rest of the GPU: the worker's CUDA context and allocator ({RESERVED_GIB:g} GiB "
            "planned); it must be free when vLLM starts",
        )
        self.row("serve", "weights", gib(s.weights), f"parameters{per} x {SERVE_DTYPE_BYTES} B")
        self.row(
            "serve",
            "LoRA slots",
            gib(s.lora),
            f"{self.max_loras} adapters x rank {self.rank_slot} (--max-lora-rank) x every "
            f"linear layer's input + output{per} x {SERVE_DTYPE_BYTES} B",
        )
        self.row(
            "serve",
            "vLLM overhead",
            gib(s.overhead),
            f"outside torch {NON_TORCH_GIB:g} GiB"
            + (f" + NCCL {NCCL_GIB:g} GiB" if s.tp > 1 else "")
            + f", CUDA graphs {CUDA_GRAPHS_GIB:g} GiB, profiling pass of {batched} tokens "
            f"and {seqs} sequences' fp32 logits",
        )
        kv_heads = max(1, shape.num_kv_heads // s.tp)
        self.row(
            "serve",
            "KV cache",
            gib(max(0.0, s.kv_bytes)),
            f"{s.kv_tokens} tokens of {s.kv_per_token // 1024} KiB "
            f"(2 x {shape.num_layers} layers x {kv_heads} KV heads x {shape.head_dim} x "
            f"{SERVE_DTYPE_BYTES} B)",
        )

    def context_for(self, s: _Serving) -> tuple[int | None, str | None]:
        """max_model_len, or why there is none."""
        fixed = s.weights + s.lora + s.overhead
        if s.kv_bytes <= 0:
            split = f" (split {s.tp} ways)" if s.tp > 1 else ""
            return None, (
                f"{self.model} does not fit {self.where} for serving: "
                f"weights {gib(s.weights)}, LoRA slots {gib(s.lora)} and vLLM's overhead "
                f"{gib(s.overhead)} make {gib(fixed)} per GPU{split}, more than vLLM's "
                f"{gib(s.budget)} of each {self.gpu.name}: use a GPU with more memory, more "
                "GPUs, or fewer or smaller LoRA slots"
            )
        if self.context is not None:
            if s.kv_tokens < self.context:
                return None, (
                    f"a context of {self.context} tokens needs "
                    f"{gib(self.context * s.kv_per_token)} of KV cache, and "
                    f"{self.where} leaves {gib(s.kv_bytes)} "
                    f"({s.kv_tokens} tokens) after the weights: ask for a context of at most "
                    f"{s.kv_tokens // CONTEXT_STEP * CONTEXT_STEP}, or a larger GPU"
                )
            return self.context, None
        length = min(
            self.wanted_context,
            s.kv_tokens // CONCURRENT_SEQUENCES // CONTEXT_STEP * CONTEXT_STEP,
        )
        if length < min(MIN_CONTEXT, self.wanted_context):
            return None, (
                f"{self.model} on {self.where} leaves {gib(s.kv_bytes)} of "
                f"KV cache ({s.kv_tokens} tokens): fewer than {CONCURRENT_SEQUENCES} sequences "
                f"of {MIN_CONTEXT} tokens; use a GPU with more memory or more GPUs"
            )
        return length, None

    def plan_training(self, s: _Serving, max_model_len: int) -> WorkerPlan:
        shape, gpu = self.shape, self.gpu
        asleep = (NON_TORCH_GIB + (NCCL_GIB if s.tp > 1 else 0) + CUDA_GRAPHS_GIB) * GIB
        free_per_gpu = gpu.memory_bytes * (1 - ALLOCATOR_SLACK) - asleep - TRAINER_CONTEXT_GIB * GIB
        weights = shape.parameters() * 2
        # FSDP shards the decoder layers only: the rest stays whole on every rank.
        whole = shape.unsharded_parameters() * 2
        lora_params = shape.lora_parameters(rank=self.lora_rank, modules=self.lora_modules)
        lora = lora_params * LORA_TRAINING_BYTES_PER_PARAMETER
        wanted_row = self.row_tokens or max_model_len

        layer = (weights - whole) / max(shape.num_layers, 1)

        def longest_on(gpus: int) -> tuple[int | None, bool, float]:
            """The longest row on each of ``gpus`` shards, whether it needs checkpointing,
            the room per GPU."""
            held = weights if gpus == 1 else (weights - whole) / gpus + whole + 2 * layer
            room = free_per_gpu - held - lora

            def fits(tokens: int, checkpointing: bool) -> bool:
                return self.activations(tokens, checkpointing=checkpointing) <= room

            checkpointing = not fits(wanted_row, False)
            longest = self.longest_row(wanted_row, lambda tokens: fits(tokens, checkpointing))
            return longest, checkpointing, room

        # One GPU when it holds the wanted row, else shards over every GPU of the node; a
        # worker of several nodes shards over every GPU of every node.
        trainer_gpus = 1
        longest, checkpointing, room = longest_on(1)
        if self.nodes > 1:
            trainer_gpus = self.count * self.nodes
            longest, checkpointing, room = longest_on(trainer_gpus)
        elif self.count > 1 and (longest or 0) < wanted_row:
            sharded = longest_on(self.count)
            if (sharded[0] or 0) > (longest or 0):
                trainer_gpus = self.count
                longest, checkpointing, room = sharded
        self.row(
            "train",
            "kept aside",
            gib(gpu.memory_bytes - free_per_gpu),
            f"vLLM asleep at level {SLEEP_LEVEL} (weights to host, KV cache dropped) keeps "
            f"memory outside torch and its CUDA graphs {gib(asleep)}; the trainer's CUDA "
            f"context {TRAINER_CONTEXT_GIB:g} GiB; {ALLOCATOR_SLACK:.0%} of the GPU left to the "
            "allocator",
        )
        if trainer_gpus > 1:
            self.row(
                "train",
                "base weights",
                gib((weights - whole) / trainer_gpus + whole + 2 * layer),
                f"decoder layers x 2 B (bf16) = {gib(weights - whole)} over {trainer_gpus} "
                f"shards (FSDP2), + embeddings, output layer and final norm whole on each "
                f"{gib(whole)}, + 2 layers gathered at a time {gib(2 * layer)}",
            )
        else:
            self.row("train", "base weights", gib(weights), "parameters x 2 B (bf16)")
        self.row(
            "train",
            "LoRA states",
            gib(lora),
            f"{lora_params / 1e6:.1f} M parameters (rank {self.lora_rank}) x "
            f"{LORA_TRAINING_BYTES_PER_PARAMETER} B (fp32 weights, gradients, Adam's moments)",
        )
        self.row(
            "train",
            "room for activations",
            gib(max(0.0, room)),
            "each GPU less what is kept aside, its weights and the LoRA states"
            + (f" (each of {trainer_gpus} trainer processes)" if trainer_gpus > 1 else ""),
        )
        if longest is None:
            needed = self.activations(MIN_ROW_TOKENS, checkpointing=True)
            return self.refuse(
                s,
                f"{self.model} does not fit {self.where} for training: base weights "
                f"{gib(weights)}"
                + (f" over {trainer_gpus} shards" if trainer_gpus > 1 else "")
                + f" and LoRA states {gib(lora)} leave {gib(max(0.0, room))} a GPU, "
                f"and a row of {MIN_ROW_TOKENS} tokens needs {gib(needed)} of activations even "
                "with gradient checkpointing: use a GPU with more memory, more GPUs, or a "
                "smaller LoRA rank",
                max_model_len=max_model_len,
            )
        self.row(
            "train",
            "longest row",
            f"{longest} tokens",
            "activations (shapes.activation_bytes) fit the room"
            + (" with gradient checkpointing" if checkpointing else " without checkpointing"),
        )
        host = host_needs(
            shape,
            pinned_bytes=(s.weights + s.lora) * s.tp,
            vllm_gpus=s.tp,
            trainer_shards=trainer_gpus,
            trainer_bytes=weights + lora,
            parked_trainers=self.tinker_runs,
        )
        host_gb, disk_gb = host.memory_gb, host.disk_gb
        self.row("host", "memory", f"{host_gb} GB", host.memory_how)
        self.row("host", "disk", f"{disk_gb} GB", host.disk_how)
        sequences = s.kv_tokens / max_model_len
        reason = (
            f"fits {self.where}: vLLM on {s.tp} GPU{'s' if s.tp > 1 else ''} "
            + (f"x {self.nodes} pipeline stages " if self.nodes > 1 else "")
            + f"with {s.kv_tokens} tokens of KV cache ({sequences:.1f} sequences of "
            f"{max_model_len}); training rows up to {longest} tokens"
            + (" with gradient checkpointing" if checkpointing else "")
            + (f" on {trainer_gpus} sharded trainer processes" if trainer_gpus > 1 else "")
        )
        return WorkerPlan(
            model=self.model,
            gpu=f"{gpu.name}:{self.count}",
            fits=True,
            reason=reason,
            max_model_len=max_model_len,
            gpu_memory_utilization=self.util,
            kv_cache_tokens=s.kv_tokens,
            tensor_parallel_size=s.tp,
            sleep_level=SLEEP_LEVEL,
            trainer_dtype="bfloat16",
            trainer_device_map="fsdp" if trainer_gpus > 1 else "cuda:0",
            trainer_shards=trainer_gpus,
            gradient_checkpointing=checkpointing,
            max_row_tokens=longest,
            host_memory_gb=host_gb,
            disk_gb=disk_gb,
            rows=self.rows,
            nodes=self.nodes,
        )

    def activations(self, row_tokens: int, *, checkpointing: bool) -> float:
        """The activation memory of one training row of ``row_tokens`` tokens in bf16, with
        this plan's LoRA adapter (``shapes.activation_bytes``)."""
        return activation_bytes(
            self.shape,
            row_tokens=row_tokens,
            chunk_size=LOGPROB_CHUNK_SIZE,
            dtype_bytes=2,
            gradient_checkpointing=checkpointing,
            lora_rank=self.lora_rank,
            lora_modules=self.lora_modules,
        )

    @staticmethod
    def longest_row(wanted: int, fits: Callable[[int], bool]) -> int | None:
        """``wanted`` if it fits, else the longest multiple of ROW_STEP that does (None below
        MIN_ROW_TOKENS)."""
        if fits(wanted):
            return wanted
        low, high = 0, wanted // ROW_STEP
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle * ROW_STEP):
                low = middle
            else:
                high = middle - 1
        longest = low * ROW_STEP
        return longest if longest >= min(MIN_ROW_TOKENS, wanted) else None

    def refuse(
        self, s: _Serving | None, reason: str, *, max_model_len: int | None = None
    ) -> WorkerPlan:
        return WorkerPlan(
            model=self.model,
            gpu=f"{self.gpu.name}:{self.count}",
            fits=False,
            reason=reason,
            max_model_len=max_model_len,
            gpu_memory_utilization=self.util,
            kv_cache_tokens=s.kv_tokens if s else 0,
            tensor_parallel_size=s.tp if s else 1,
            sleep_level=SLEEP_LEVEL,
            trainer_dtype="bfloat16",
            trainer_device_map="cuda:0",
            trainer_shards=1,
            gradient_checkpointing=True,
            max_row_tokens=None,
            host_memory_gb=None,
            disk_gb=None,
            rows=self.rows,
            nodes=self.nodes,
        )
