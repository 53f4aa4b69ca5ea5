"""A base model's shape, read from its ``config.json``, and the sizes that follow from it.

Parameters are counted the way the model is built: the token embedding (and an output layer
of the same size unless ``tie_word_embeddings``), per layer the attention projections with
grouped-query attention (``num_key_value_heads`` heads of ``head_dim`` for keys and values;
Qwen2's q/k/v biases), the gated MLP (gate, up and down; a mixture of experts' routed and
shared experts when the config names them), and the RMSNorm weights. The KV cache per token
is vLLM's rule (``vllm/v1/kv_cache_interface.py``, ``AttentionSpec.page_size_bytes``): keys and
values, ``head_dim`` each, for every KV head a GPU holds, in every layer, at the model's dtype.

A config this module cannot count (no decoder sizes, quantized weights) raises
``UnplannableModel``: the plan then says "unknown" and leaves the decision to the worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# vLLM serves bf16 (or fp16) weights and KV cache: --dtype auto turns fp32 checkpoints into
# bf16 too, and the trainer loads bf16 on CUDA.
SERVE_DTYPE_BYTES = 2
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# The linear layers of a decoder layer, and which of their sides tensor parallelism splits:
# column-parallel layers split their output, row-parallel ones their input.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


class UnplannableModel(ValueError):
    """The config does not say enough to count the model's memory."""


def _int(config: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    # Per-head RMSNorm on queries and keys (Qwen3).
    qk_norm: bool = False
    max_position_embeddings: int | None = None
    # Bytes per weight in the checkpoint files (the disk a copy takes).
    checkpoint_dtype_bytes: int = SERVE_DTYPE_BYTES
    # A mixture of experts: routed experts of their own width, and shared ones.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape a Hugging Face ``config.json`` describes (a multimodal model's text part)."""
        text = config.get("text_config")
        if isinstance(text, Mapping):
            config = {**config, **text}
        if config.get("quantization_config"):
            raise UnplannableModel(
                "its weights are quantized, and the plan counts bf16 weights only"
            )
        hidden = _int(config, "hidden_size", "n_embd", "d_model")
        layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
        heads = _int(config, "num_attention_heads", "n_head")
        vocab = _int(config, "vocab_size")
        if hidden is None or layers is None or heads is None or vocab is None:
            raise UnplannableModel(
                "its config.json does not name hidden_size, num_hidden_layers, "
                "num_attention_heads and vocab_size"
            )
        experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts") or 0
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        model_type = str(config.get("model_type", ""))
        return cls(
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size", "n_inner") or 4 * hidden,
            num_layers=layers,
            vocab_size=vocab,
            num_attention_heads=heads,
            num_kv_heads=_int(config, "num_key_value_heads", "num_kv_heads") or heads,
            head_dim=_int(config, "head_dim") or hidden // heads,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type.startswith("qwen3"),
            max_position_embeddings=_int(config, "max_position_embeddings", "n_positions"),
            checkpoint_dtype_bytes=_DTYPE_BYTES.get(dtype, SERVE_DTYPE_BYTES),
            num_experts=experts,
            experts_per_token=(_int(config, "num_experts_per_tok", "moe_topk") or 1)
            if experts
            else 0,
            expert_intermediate_size=(
                _int(config, "moe_intermediate_size") or _int(config, "intermediate_size") or 0
            )
            if experts
            else 0,
            shared_expert_intermediate_size=(_int(config, "shared_expert_intermediate_size") or 0)
            if experts
            else 0,
        )

    # --- parameters ------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(input, output) features of each dense linear layer of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
        }
        if not self.num_experts:
            shapes |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return shapes

    def expert_shapes(self) -> list[tuple[int, int]]:
        """(input, output) of every expert linear layer of one decoder layer, shared included."""
        h = self.hidden_size
        shapes = []
        for width, count in (
            (self.expert_intermediate_size, self.num_experts),
            (
                self.shared_expert_intermediate_size,
                1 if self.shared_expert_intermediate_size else 0,
            ),
        ):
            shapes += [(h, width), (h, width), (width, h)] * count
        return shapes

    def layer_parameters(self, *, tp: int = 1) -> int:
        """Weights of one decoder layer on one of ``tp`` tensor-parallel GPUs.

        Matrices are split ``tp`` ways; KV heads fewer than ``tp`` are copied, not split (as
        vLLM does); norms are copied on every GPU.
        """
        kv_share = max(1, self.num_kv_heads // tp) * self.head_dim
        total = 0
        for name, (fan_in, fan_out) in self.linear_shapes().items():
            if name in ("k_proj", "v_proj"):
                total += fan_in * kv_share + (kv_share if self.attention_bias else 0)
            else:
                total += fan_in * fan_out // tp
                if name == "q_proj" and self.attention_bias:
                    total += fan_out // tp
        total += sum(fan_in * fan_out for fan_in, fan_out in self.expert_shapes()) // tp
        if self.num_experts:
            total += self.hidden_size * self.num_experts  # the router
        total += 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return total

    def parameters(self, *, tp: int = 1) -> int:
        """Every weight of the model, or those one of ``tp`` tensor-parallel GPUs holds."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return (
            math.ceil(embeddings / tp)
            + self.num_layers * self.layer_parameters(tp=tp)
            + (self.hidden_size)
        )

    def unsharded_parameters(self) -> int:
        """The weights a sharded trainer keeps whole on every rank (``trainer.distributed``):
        the embeddings, the output layer unless tied, and the final norm."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return embeddings + self.hidden_size

    def lora_parameters(self, *, rank: int, modules: tuple[str, ...] | None = None) -> int:
        """Parameters of a LoRA adapter of ``rank`` on ``modules`` (default: every linear layer
        of the decoder, as vLLM's LoRA slots hold), over all layers."""
        wanted = set(modules) if modules is not None else None
        per_layer = sum(
            rank * (fan_in + fan_out)
            for name, (fan_in, fan_out) in self.linear_shapes().items()
            if wanted is None or name in wanted
        )
        if wanted is None or wanted & set(MLP_MODULES):
            per_layer += sum(rank * (fan_in + fan_out) for fan_in, fan_out in self.expert_shapes())
        return self.num_layers * per_layer

    def lora_slot_parameters(self, *, rank: int, tp: int = 1) -> int:
        """One vLLM LoRA slot of ``rank`` on one of ``tp`` GPUs: A is ``rank x input`` and B
        ``output x rank`` for every linear layer; column-parallel layers split B's output,
        row-parallel ones A's input (``vllm/lora/layers``)."""
        per_layer = 0
        for name, (fan_in, fan_out) in self.linear_shapes().items():
            if name in ROW_PARALLEL:
                per_layer += rank * (fan_in // tp + fan_out)
            else:
                per_layer += rank * (fan_in + fan_out // tp)
        per_layer += (
            sum(rank * (fan_in + fan_out) for fan_in, fan_out in self.expert_shapes()) // tp
        )
        return self.num_layers * per_layer

    @property
    def mlp_width(self) -> int:
        """The MLP's intermediate width one token goes through (its experts' and the shared
        one's, for a mixture of experts)."""
        if not self.num_experts:
            return self.intermediate_size
        return (
            self.experts_per_token * self.expert_intermediate_size
            + self.shared_expert_intermediate_size
        )

    # --- the KV cache ----------------------------------------------------------------------

    def kv_cache_bytes_per_token(self, *, tp: int = 1, dtype_bytes: int = SERVE_DTYPE_BYTES) -> int:
        """vLLM's KV cache of one token on one of ``tp`` GPUs: keys and values of every KV head
        it holds, in every layer (KV heads fewer than ``tp`` are copied)."""
        kv_heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * kv_heads_per_gpu * self.head_dim * dtype_bytes

    def splits_over(self, tp: int) -> bool:
        """Whether vLLM can split this model over ``tp`` GPUs: attention heads (and KV heads,
        or ``tp`` by them) divide evenly, and so does the MLP."""
        if self.num_attention_heads % tp:
            return False
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            return False
        if self.num_kv_heads < tp and tp % self.num_kv_heads:
            return False
        return all(
            width % tp == 0
            for width in (self.intermediate_size, self.expert_intermediate_size)
            if width
        )


# peft keeps LoRA weights in fp32 (``autocast_adapter_dtype``) and casts each input to them.
ADAPTER_DTYPE_BYTES = 4
FP32_BYTES = 4


def _lora_saved_bytes_per_token(
    shape: ModelShape, *, dtype_bytes: int, lora_rank: int, lora_modules: tuple[str, ...] | None
) -> int:
    """What peft's LoRA layers of one decoder layer keep for the backward pass, per token.

    Each targeted layer runs ``lora_B(lora_A(x.to(fp32)))``: autograd keeps the fp32 input
    (for A's gradient) and A's output (for B's). When the model is not fp32 every targeted
    layer makes its own copy of its input (q, k and v three of the same one); in an fp32
    model the cast is a no-op, so they share the input the layer got: the norm's output once
    for q/k/v and once for gate/up, down's input, and o's input is the attention output
    already counted.
    """
    fan_ins = {name: fan_in for name, (fan_in, _) in shape.linear_shapes().items()}
    if shape.num_experts:
        fan_ins |= {name: shape.hidden_size for name in ("gate_proj", "up_proj")}
        fan_ins["down_proj"] = shape.mlp_width
    targeted = [name for name in fan_ins if lora_modules is None or name in lora_modules]
    if dtype_bytes != ADAPTER_DTYPE_BYTES:
        inputs = sum(fan_ins[name] for name in targeted)
    else:
        shared = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"down_proj"})
        inputs = sum(
            fan_ins[min(group & set(targeted))] for group in shared if group & set(targeted)
        )
    return ADAPTER_DTYPE_BYTES * (inputs + lora_rank * len(targeted))


def layer_activation_bytes_per_token(
    shape: ModelShape,
    *,
    dtype_bytes: int,
    lora_rank: int,
    lora_modules: tuple[str, ...] | None = None,
) -> int:
    """What autograd keeps of one decoder layer for one token (see ``activation_bytes``)."""
    h = shape.hidden_size
    # RMSNorm upcasts its input to fp32 and keeps it with its 1/rms; the weight's product is
    # not kept (the weight is frozen).
    norms = 2 * (FP32_BYTES * h + FP32_BYTES)
    # SDPA keeps the rotated q and k, v, its output and the softmax's log-sum-exp per head.
    attention = dtype_bytes * (2 * shape.q_size + 2 * shape.kv_size) + (
        FP32_BYTES * shape.num_attention_heads
    )
    # SwiGLU: gate's and up's outputs and the activated gate.
    mlp = 3 * dtype_bytes * shape.mlp_width
    lora = _lora_saved_bytes_per_token(
        shape, dtype_bytes=dtype_bytes, lora_rank=lora_rank, lora_modules=lora_modules
    )
    return norms + attention + mlp + lora


def activation_bytes(
    shape: ModelShape,
    *,
    row_tokens: int,
    chunk_size: int,
    dtype_bytes: int,
    gradient_checkpointing: bool,
    lora_rank: int,
    lora_modules: tuple[str, ...] | None = None,
    packed: bool = True,
) -> int:
    """Bytes a training forward and backward pass over one row of ``row_tokens`` keeps alive.

    Per layer and token, what autograd keeps for the backward pass (measured with
    ``saved_tensors_hooks`` on a tiny model: ``tests/trainer/test_activation_plan.py``):

    - each of the two RMSNorms: the fp32 copy it normalizes (transformers upcasts) and 1/rms;
    - attention: the rotated q and k, v, the attention output (o_proj's input) and the
      softmax's log-sum-exp; SDPA never materializes the score matrix;
    - the SwiGLU MLP: gate and up, and the activated gate;
    - peft's LoRA layers (``lora_rank``, on ``lora_modules``, default all): each one's input
      cast to fp32 and its A's output (``_lora_saved_bytes_per_token``).

    With gradient checkpointing, every layer's input plus one layer's worth (the one being
    recomputed); without, every layer's worth and the final norm's. Beside the layers: the
    rotary tables, then the output layer's fp32 logits, their log-softmax and its gradient
    for one chunk of ``chunk_size`` tokens, and for a packed row (``packed``) its ``L x L``
    attention mask, as a bool and as the additive bias SDPA makes.
    """
    h = shape.hidden_size
    per_layer = row_tokens * layer_activation_bytes_per_token(
        shape, dtype_bytes=dtype_bytes, lora_rank=lora_rank, lora_modules=lora_modules
    )
    rotary = row_tokens * 2 * shape.head_dim * dtype_bytes
    if gradient_checkpointing:
        # The final norm's tensors are gone before the first layer is recomputed.
        layers = per_layer + shape.num_layers * row_tokens * h * dtype_bytes
    else:
        layers = shape.num_layers * per_layer + row_tokens * (FP32_BYTES * h + FP32_BYTES)
    logits = 3 * min(row_tokens, chunk_size) * shape.vocab_size * 4
    mask = row_tokens * row_tokens * (1 + dtype_bytes) if packed else 0
    return layers + rotary + logits + mask
