"""Mixture-of-experts base models are refused, with the reason, before anything is launched.

skytrain has never shown a LoRA it trained on a mixture of experts loading into vLLM: peft
adapts the experts' weights under keys of its own (transformers keeps each layer's experts
fused, in one tensor), and whether vLLM's LoRA loader maps them onto its fused-MoE layers is
untested here; at the rank workers load (64) the LoRA slots of every expert also take
tens of GiB a GPU (Qwen3-30B-A3B: about 25 GiB at rank 64 and four adapters). So a base model
whose ``config.json`` names routed experts is refused where a model is created, by
``skytrain workers plan`` and by the worker, with ``refusal``'s words, until a tiny MoE
LoRA trained by skytrain loads into real vLLM (``scripts/test-vllm.sh``'s CPU build).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The names configs give their routed experts' count: Qwen2/3-MoE and Jamba (num_experts),
# Mixtral, Llama 4 and gpt-oss (num_local_experts), DeepSeek (n_routed_experts), DBRX
# (ffn_config.moe_num_experts), and others (num_routed_experts, moe_num_experts).
EXPERT_COUNT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_routed_experts",
    "moe_num_experts",
)
# Where a config nests its decoder's settings (multimodal models, DBRX).
NESTED_CONFIGS = ("text_config", "ffn_config", "llm_config", "language_config")


def expert_count(config: Mapping[str, Any]) -> int:
    """How many routed experts a layer of the model has, by its ``config.json`` (0: dense)."""
    counts = [0]
    for section in (config, *(config.get(name) for name in NESTED_CONFIGS)):
        if not isinstance(section, Mapping):
            continue
        for key in EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                counts.append(value)
    # One "expert" is a dense MLP (configs of dense models sometimes say so).
    return max(counts) if max(counts) > 1 else 0


def refusal(base_model: str, experts: int) -> str:
    """Why a base model of ``experts`` routed experts a layer is refused, and what to do."""
    return (
        f"base model {base_model} is a mixture of experts ({experts} experts a layer), and "
        "skytrain does not train mixtures of experts yet: vLLM has not been shown to load "
        "the LoRA adapters peft makes for their experts. Choose a dense base model, such as "
        "Qwen/Qwen2.5-7B-Instruct or Qwen/Qwen3-8B"
    )


def check_config(base_model: str, config: Mapping[str, Any] | None) -> str | None:
    """``refusal``'s words when ``config`` describes a mixture of experts, else None."""
    experts = expert_count(config) if config is not None else 0
    return refusal(base_model, experts) if experts else None
