"""The memory plan on real models' config.json (tests/planning/models), checked against the
models' published sizes and against vLLM's own rules, worked out here from the raw config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.planning import (
    FitsNoGpu,
    ModelShape,
    UnplannableModel,
    choose_gpu,
    find_model_config,
    parse_gpu,
    plan_worker,
)
from skytrain_backend.planning.experts import expert_count
from skytrain_backend.planning.plan import CONCURRENT_SEQUENCES

MODELS = Path(__file__).parent / "models"
GIB = 1024**3
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
QWEN_32B = "Qwen/Qwen2.5-32B-Instruct"
QWEN_72B = "Qwen/Qwen2.5-72B-Instruct"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Parameter counts on the model cards.
PUBLISHED_PARAMETERS = {
    QWEN_7B: 7.61e9,
    QWEN_32B: 32.5e9,
    QWEN_72B: 72.7e9,
    LLAMA_8B: 8.03e9,
    SMOLLM2: 135e6,
}


def _config(model: str) -> dict[str, Any]:
    config = find_model_config(model, cache_dir=MODELS)
    assert config is not None
    return config


def _shape(model: str) -> ModelShape:
    return ModelShape.from_config(_config(model))


def _plan(model: str, gpu: str, **options: Any) -> Any:
    spec = parse_gpu(gpu)
    assert spec.gpu is not None
    return plan_worker(_shape(model), spec.gpu, model=model, gpu_count=spec.count, **options)


@pytest.mark.parametrize("model", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_the_model_card(model: str) -> None:
    counted = _shape(model).parameters()
    assert counted == pytest.approx(PUBLISHED_PARAMETERS[model], rel=0.01)


def _vllm_kv_bytes_per_token(config: dict[str, Any], tp: int) -> int:
    """vLLM 0.34's KV cache of one token on one of ``tp`` GPUs, by its own rule from the raw
    config: per layer a FullAttentionSpec page (``vllm/v1/kv_cache_interface.py``) is
    num_kv_heads x block_size x (head_size + head_size_v) x dtype bytes, with num_kv_heads
    = max(1, total // tp) (``ModelConfig.get_num_kv_heads``) and head_size = head_dim, else
    hidden_size // num_attention_heads (``model_arch_config_convertor.get_head_size``)."""
    block_size, dtype_bytes = 16, 2
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    total_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    page_bytes = max(1, total_kv_heads // tp) * block_size * (head_size + head_size) * dtype_bytes
    return config["num_hidden_layers"] * page_bytes // block_size


@pytest.mark.parametrize("model", sorted(PUBLISHED_PARAMETERS))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_cache_per_token_is_vllms(model: str, tp: int) -> None:
    config = _config(model)
    assert _shape(model).kv_cache_bytes_per_token(tp=tp) == _vllm_kv_bytes_per_token(config, tp)


def test_qwen_7b_weights_and_lora_slots_are_what_vllm_allocates() -> None:
    """bf16 weights, and vLLM's LoRA buffers for 4 adapters at --max-lora-rank 64 on every
    linear layer: lora_a_stacked (max_loras, 1, rank, input) and lora_b_stacked (max_loras, 1,
    output, rank) per slice of qkv_proj, o_proj, gate_up_proj, down_proj
    (``vllm/lora/layers/base_linear.py``), in bf16."""
    config = _config(QWEN_7B)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    slices = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    slices += [(hidden, inter), (hidden, inter), (inter, hidden)]
    rank, max_loras = 64, 4
    per_layer = sum(max_loras * rank * (fan_in + fan_out) for fan_in, fan_out in slices)
    vllm_lora_bytes = config["num_hidden_layers"] * per_layer * 2

    plan = _plan(QWEN_7B, "L4:1", lora_rank=64, max_loras=4)
    rows = {row.item: row.value for row in plan.rows if row.phase == "serve"}
    assert rows["LoRA slots"] == f"{vllm_lora_bytes / GIB:.2f} GiB" == "1.20 GiB"
    assert rows["weights"] == "14.19 GiB"


@pytest.mark.parametrize("gpu", ["L4:1", "A10G:1"])
def test_qwen_7b_fits_a_24_gb_gpu_with_a_shorter_context(gpu: str) -> None:
    plan = _plan(QWEN_7B, gpu)
    assert plan.fits, plan.reason
    assert 2048 <= plan.max_model_len <= 32768
    # The KV cache holds several sequences of the context chosen, never less than one.
    assert plan.kv_cache_tokens >= CONCURRENT_SEQUENCES * plan.max_model_len
    assert plan.tensor_parallel_size == 1 and plan.sleep_level == 1
    # Weights pinned in host memory while vLLM sleeps: more than the 16 GB of the smallest L4
    # hosts.
    assert plan.host_memory_gb > 16
    assert plan.gradient_checkpointing and plan.max_row_tokens >= 1024


def test_a_context_that_does_not_fit_is_refused_naming_the_longest_that_does() -> None:
    plan = _plan(LLAMA_8B, "L4:1", context=65536, lora_rank=8)
    assert not plan.fits
    assert "a context of 65536 tokens needs 8.00 GiB of KV cache" in plan.reason
    longest = int(plan.reason.split("ask for a context of at most ")[1].split(",")[0])
    assert 2048 <= longest < 65536
    assert _plan(LLAMA_8B, "L4:1", context=longest, lora_rank=8).fits
    assert not _plan(LLAMA_8B, "L4:1", context=longest + 1024, lora_rank=8).fits


def test_a_context_beyond_the_models_own_is_refused() -> None:
    plan = _plan(SMOLLM2, "H100:1", context=16384)
    assert not plan.fits
    assert "beyond HuggingFaceTB/SmolLM2-135M-Instruct's own 8192" in plan.reason


def test_qwen_32b_does_not_fit_an_l4() -> None:
    plan = _plan(QWEN_32B, "L4:1")
    assert not plan.fits
    assert "does not fit 1 x L4 for serving: weights 61.03 GiB" in plan.reason
    assert plan.host_memory_gb is None and plan.max_model_len is None


def test_qwen_72b_does_not_fit_one_h100() -> None:
    plan = _plan(QWEN_72B, "H100:1")
    assert not plan.fits
    assert "does not fit 1 x H100 for serving: weights 135.43 GiB" in plan.reason


def test_qwen_72b_is_split_over_an_h100_node() -> None:
    plan = _plan(QWEN_72B, "H100:8")
    assert plan.fits, plan.reason
    assert plan.tensor_parallel_size in (2, 4, 8)
    assert plan.max_model_len == 32768
    # 145 GB of bf16 weights: the trainer runs as processes over which FSDP shards them.
    assert plan.trainer_device_map == "fsdp"
    assert plan.trainer_shards in (2, 4, 8)
    # vLLM's pinned weights, and the first trainer process's copy while it loads (the
    # others receive their shards from it).
    assert 2 * 145 < plan.host_memory_gb < 3 * 145
    rows = {row.item: row for row in plan.rows if row.phase == "train"}
    assert f"over {plan.trainer_shards} shards (FSDP2)" in rows["base weights"].how
    assert plan.worker_envs()["SKYTRAIN_TRAINER_SHARDS"] == str(plan.trainer_shards)


def test_a_trainer_one_gpu_cannot_hold_is_sharded_over_the_whole_node() -> None:
    """Qwen2.5-72B's 135 GiB of weights: an H100 pair cannot even serve it (refused with the
    arithmetic); on 4 or 8 the engine and the trainer use every GPU."""
    pair = _plan(QWEN_72B, "H100:2")
    assert not pair.fits
    four, eight = _plan(QWEN_72B, "H100:4"), _plan(QWEN_72B, "H100:8")
    assert four.fits and eight.fits, (four.reason, eight.reason)
    assert (four.tensor_parallel_size, four.trainer_shards) == (4, 4)
    assert (eight.tensor_parallel_size, eight.trainer_shards) == (8, 8)
    assert eight.max_row_tokens > four.max_row_tokens
    assert eight.kv_cache_tokens > four.kv_cache_tokens


def test_qwen_32b_uses_both_gpus_of_an_a100_pair() -> None:
    plan = _plan(QWEN_32B, "A100-80GB:2")
    assert plan.fits, plan.reason
    assert plan.tensor_parallel_size == 2 and plan.trainer_shards == 2
    # One A100 alone holds it only at a context far below the model's own.
    alone = _plan(QWEN_32B, "A100-80GB:1")
    assert alone.fits and alone.max_model_len < plan.max_model_len == 32768


def test_tensor_parallelism_only_splits_the_heads_evenly() -> None:
    """Qwen2.5-7B has 28 attention heads: 8 GPUs cannot split them, 2 and 4 can."""
    shape = _shape(QWEN_7B)
    assert [tp for tp in (1, 2, 4, 8) if shape.splits_over(tp)] == [1, 2, 4]
    plan = _plan(QWEN_7B, "L4:8", context=32768)
    assert plan.fits, plan.reason
    assert plan.tensor_parallel_size in (2, 4)


def test_a_small_model_trains_full_rows_without_gradient_checkpointing() -> None:
    plan = _plan(SMOLLM2, "L4:1")
    assert plan.fits
    assert plan.max_model_len == 8192  # the model's own context
    assert plan.max_row_tokens == 8192 and not plan.gradient_checkpointing
    assert plan.trainer_device_map == "cuda:0" and plan.trainer_shards == 1


def test_rows_are_cut_to_what_the_gpu_holds_for_training() -> None:
    """Llama-3.1-8B's 128k vocabulary and rank-64 LoRA states leave an L4 too little room for
    a 1024-token row; at rank 8 it trains."""
    plan = _plan(LLAMA_8B, "L4:1")
    assert not plan.fits
    assert "does not fit 1 x L4 for training" in plan.reason
    assert "a row of 1024 tokens needs" in plan.reason
    smaller = _plan(LLAMA_8B, "L4:1", lora_rank=8)
    assert smaller.fits, smaller.reason
    assert 1024 <= smaller.max_row_tokens < smaller.max_model_len


def test_the_cheapest_configured_gpu_that_fits_is_chosen() -> None:
    choice = choose_gpu(_shape(QWEN_7B), ["H100:1", "A10G:1", "L4:1"], model=QWEN_7B)
    assert str(choice.spec) == "L4:1" and choice.plan is not None and choice.plan.fits
    bigger = choose_gpu(_shape(QWEN_32B), ["L4:1", "H100:1", "A100-80GB:1"], model=QWEN_32B)
    assert str(bigger.spec) == "A100-80GB:1"


def test_fitting_no_configured_gpu_is_an_invalid_request_with_each_reason() -> None:
    with pytest.raises(FitsNoGpu) as raised:
        choose_gpu(_shape(QWEN_72B), ["L4:1", "H100:1"], model=QWEN_72B)
    message = raised.value.message
    assert "fits none of the GPUs workers may get (L4:1, H100:1)" in message
    assert "L4:1: Qwen/Qwen2.5-72B-Instruct does not fit 1 x L4" in message
    assert "H100:1: Qwen/Qwen2.5-72B-Instruct does not fit 1 x H100" in message
    assert raised.value.status_code == 400


def test_an_unknown_gpu_leaves_the_choice_to_the_worker() -> None:
    choice = choose_gpu(_shape(QWEN_72B), ["L4:1", "MI300X:1"], model=QWEN_72B)
    assert choice.spec is None and choice.plan is None
    assert [plan.gpu for plan in choice.plans] == ["L4:1"]


def test_a_config_without_the_decoder_sizes_or_with_quantized_weights_is_unplannable() -> None:
    with pytest.raises(UnplannableModel, match="hidden_size"):
        ModelShape.from_config({"model_type": "bert"})
    quantized = {**_config(QWEN_7B), "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(UnplannableModel, match="quantized"):
        ModelShape.from_config(quantized)


def test_a_config_is_found_in_a_model_directory_and_not_for_an_unknown_id(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "my-model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_config(SMOLLM2)))
    assert find_model_config(str(directory), cache_dir=MODELS) == _config(SMOLLM2)
    assert find_model_config("nobody/no-such-model", cache_dir=MODELS) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [("L4:0", "1 to 16"), ("H100:x", "NAME or NAME:COUNT"), ("", "NAME or NAME:COUNT")],
)
def test_a_malformed_gpu_spec_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_gpu(spec)


def test_a_sharded_trainer_counts_the_embeddings_whole_on_every_gpu() -> None:
    """trainer.distributed keeps the embeddings, lm_head and final norm whole on each rank:
    4.64 GiB per GPU for Qwen2.5-72B that dividing every weight by the shards left out."""
    config = _config(QWEN_72B)
    plan = _plan(QWEN_72B, "H100:8")
    assert plan.trainer_shards == 8
    shape = _shape(QWEN_72B)
    whole = (2 * config["vocab_size"] * config["hidden_size"] + config["hidden_size"]) * 2
    assert whole / GIB == pytest.approx(4.64, abs=0.01)
    layers = shape.parameters() * 2 - whole
    gathered = 2 * layers / config["num_hidden_layers"]
    per_gpu = layers / 8 + whole + gathered
    row = {row.item: row for row in plan.rows if row.phase == "train"}["base weights"]
    assert row.value == f"{per_gpu / GIB:.2f} GiB"
    assert "output layer and final norm whole on each 4.64 GiB" in row.how


def test_host_memory_counts_the_tinker_runs_trainers_parked_between_operations() -> None:
    """Each parked Tinker run holds its whole trainer in host memory (Trainer.offload): for
    a 7B on an L4, two runs add about 29 GiB to vLLM's 14 GiB of pinned weights."""
    shape = _shape(QWEN_7B)
    trainer = shape.parameters() * 2 + shape.lora_parameters(rank=8) * 16
    none = _plan(QWEN_7B, "L4:1", lora_rank=8, tinker_runs=0)
    two = _plan(QWEN_7B, "L4:1", lora_rank=8, tinker_runs=2)
    assert none.fits and two.fits
    assert (two.host_memory_gb - none.host_memory_gb) == pytest.approx(2 * trainer / 1e9, abs=1)
    assert two.host_memory_gb >= 55
    row = {row.item: row for row in two.rows if row.phase == "host"}["memory"]
    assert "2 Tinker runs' trainers parked between operations" in row.how
    # A sharded trainer runs no Tinker runs: none are counted.
    sharded = _plan(QWEN_72B, "H100:8", tinker_runs=2)
    assert sharded.host_memory_gb == _plan(QWEN_72B, "H100:8", tinker_runs=0).host_memory_gb


def test_the_rest_of_the_gpu_outside_vllms_share_is_shown() -> None:
    plan = _plan(QWEN_7B, "L4:1")
    assert plan.gpu_memory_utilization == 0.92
    row = {row.item: row for row in plan.rows if row.phase == "serve"}["outside vLLM"]
    assert row.value == f"{22_478 * 1024**2 * 0.08 / GIB:.2f} GiB"


QWEN3_MOE = "Qwen/Qwen3-30B-A3B"


@pytest.mark.parametrize(
    ("config", "experts"),
    [
        (_config(QWEN3_MOE), 128),
        ({"model_type": "mixtral", "num_local_experts": 8}, 8),
        ({"model_type": "deepseek_v3", "n_routed_experts": 256}, 256),
        ({"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16}}, 16),
        ({"model_type": "llama4", "text_config": {"num_local_experts": 16}}, 16),
        ({"model_type": "jamba", "num_experts": 1}, 0),
        (_config(QWEN_7B), 0),
    ],
)
def test_a_mixture_of_experts_is_told_by_its_config(config: dict[str, Any], experts: int) -> None:
    assert expert_count(config) == experts


def test_a_mixture_of_experts_is_refused_on_every_gpu_with_the_reason() -> None:
    """Qwen3-30B-A3B's weights fit a node of eight H100s; it is refused for being a mixture
    of experts (no LoRA of one has been shown to load into vLLM), not for its size."""
    assert _shape(QWEN3_MOE).parameters() == pytest.approx(30.5e9, rel=0.01)
    for gpu in ("L4:1", "H100:1", "H100:8"):
        plan = _plan(QWEN3_MOE, gpu, lora_rank=8)
        assert plan.fits is False
        assert plan.reason.startswith(f"base model {QWEN3_MOE} is a mixture of experts (128 ")
        assert "vLLM has not been shown to load the LoRA adapters" in plan.reason
        assert plan.host_memory_gb is None and plan.max_model_len is None
    with pytest.raises(FitsNoGpu, match="H100:8: base model Qwen/Qwen3-30B-A3B is a mixture"):
        choose_gpu(_shape(QWEN3_MOE), ["L4:1", "H100:8"], model=QWEN3_MOE)


def test_a_model_no_node_holds_is_planned_over_nodes_of_gpus() -> None:
    """Qwen2.5-72B on A100-40GB: one node of 4 cannot serve it; two nodes of 4 (vLLM's
    pipeline stages, one a node; the trainer sharded over all 8 GPUs) can, and the worker's
    settings say so."""
    one = _plan(QWEN_72B, "A100:4", lora_rank=8)
    assert not one.fits and "does not fit 4 x A100 for serving" in one.reason
    two = _plan(QWEN_72B, "A100:4", lora_rank=8, nodes=2)
    assert two.fits, two.reason
    assert two.nodes == 2 and two.tensor_parallel_size == 4
    assert (two.trainer_device_map, two.trainer_shards) == ("fsdp", 8)
    assert "fits 2 nodes of 4 x A100: vLLM on 4 GPUs x 2 pipeline stages" in two.reason
    envs = two.worker_envs()
    assert envs["SKYTRAIN_ENGINE_PIPELINE_PARALLEL_SIZE"] == "2"
    assert envs["SKYTRAIN_TRAINER_SHARDS"] == "8"
    serve = {row.item: row for row in two.rows if row.phase == "serve"}
    assert "the largest of 2 pipeline stages" in serve["weights"].how
    # A stage holds half the layers: about half the weights of one node's GPU.
    weights = [
        float(next(r.value for r in p.rows if r.item == "weights").split()[0]) for p in (one, two)
    ]
    assert 0.45 < weights[1] / weights[0] < 0.55
    # 32B on L4s: one node of 4 serves it but cannot train it; two nodes train on 8 shards.
    assert "for training" in _plan(QWEN_32B, "L4:4", lora_rank=8).reason
    assert _plan(QWEN_32B, "L4:4", lora_rank=8, nodes=2).trainer_shards == 8
    # Two nodes of one L4 are still refused, with the plan's reason.
    small = _plan(QWEN_72B, "L4:1", lora_rank=8, nodes=2)
    assert not small.fits and "does not fit 2 nodes of 1 x L4 for serving" in small.reason


def test_gpus_are_chosen_for_the_nodes_a_worker_has() -> None:
    shape = _shape(QWEN_72B)
    choice = choose_gpu(shape, ["L4:4", "A100:4"], model=QWEN_72B, lora_rank=8, nodes=2)
    assert str(choice.spec) == "A100:4" and choice.plan is not None and choice.plan.nodes == 2
    with pytest.raises(FitsNoGpu, match="does not fit 2 nodes of 1 x L4"):
        choose_gpu(shape, ["L4:1", "A10G:1"], model=QWEN_72B, lora_rank=8, nodes=2)
