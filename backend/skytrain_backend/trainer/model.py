"""The policy: a base model with a LoRA adapter, and its forward pass over packed rows.

On CUDA with ``unsloth`` importable the model is loaded with Unsloth's ``FastLanguageModel``
(faster kernels, its own gradient checkpointing); otherwise with transformers + peft. Both give
a peft model with the same adapter layout, saved with peft's ``save_pretrained`` so vLLM and
peft load it alike. Weights are bf16 on CUDA and fp32 on CPU; LoRA weights stay fp32 (peft's
default) so small updates are not rounded away. On CUDA the weights go straight onto the GPU
(``device_map``), never first into host memory whole; a model too large for one GPU is spread
over the node's GPUs layer by layer (``spread``, the memory plan's ``device_map="auto"``;
peft only).

Unsloth replaces the attention code, and custom 4D attention masks are not part of what it
promises, so with Unsloth every sequence gets its own row (``supports_packed_rows`` is False)
and the forward is an ordinary causal one. It loads the exact repository asked for
(``use_exact_model_name``), the one the engine serves; the worker imports it before
transformers and peft, as it needs. Unsloth cuts every row to the ``max_seq_length`` it was
loaded with, silently: ``Policy.max_row_tokens`` says so, and the trainer never packs a row
longer (``trainer.row_length_limit``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from skytrain_backend import hub
from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.trainer.distributed import SINGLE, Shards
from skytrain_backend.trainer.loss import token_logprobs
from skytrain_backend.trainer.memory import ActivationBudget
from skytrain_backend.trainer.packing import PackedRow

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's names for the policy's adapter and the KL reference loaded beside it.
DEFAULT_ADAPTER = "default"
REFERENCE_ADAPTER = "reference"
# Fresh adapters are initialized from this seed, so step 0 is the same on every worker.
LORA_INIT_SEED = 0


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _lora_config(model_config: ModelConfig) -> LoraConfig:
    return LoraConfig(
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        lora_dropout=model_config.lora_dropout,
        target_modules=list(model_config.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _import_unsloth() -> Any | None:
    if importlib.util.find_spec("unsloth") is None:
        return None
    try:
        from unsloth import FastLanguageModel
    except Exception as exc:  # unsloth refuses some GPUs and versions at import time
        logger.warning("unsloth is installed but failed to import (%s); using peft", exc)
        return None
    return FastLanguageModel


def _load_with_unsloth(
    fast: Any, path: str, model_config: ModelConfig, device: torch.device
) -> tuple[Any, Any]:
    model, tokenizer = fast.from_pretrained(
        model_name=path,
        max_seq_length=model_config.max_seq_length,
        dtype=torch.bfloat16,
        load_in_4bit=False,
        device_map={"": device.index or 0},
        # Train exactly the repository the engine serves: without it, Unsloth swaps in its
        # own copy of well-known models (unsloth/...), whose weights may differ.
        use_exact_model_name=True,
    )
    model = fast.get_peft_model(
        model,
        r=model_config.lora_rank,
        lora_alpha=model_config.lora_alpha,
        lora_dropout=model_config.lora_dropout,
        target_modules=list(model_config.lora_target_modules),
        bias="none",
        use_gradient_checkpointing=_unsloth_checkpointing(model_config),
        random_state=LORA_INIT_SEED,
    )
    return model, tokenizer


def _unsloth_checkpointing(model_config: ModelConfig) -> str | bool:
    """Unsloth's own checkpointing (activations offloaded to host memory) runs each layer again
    in the backward pass without putting back the random state of its forward pass: with LoRA
    dropout the gradient would go through other masks than the loss. Transformers' own
    checkpointing puts it back, so a job with dropout uses that."""
    if not model_config.gradient_checkpointing:
        return False
    return True if model_config.lora_dropout > 0 else "unsloth"


def load_device_map(device: torch.device, *, spread: bool) -> str | dict[str, int] | None:
    """Where from_pretrained puts the weights: straight onto the GPU (or spread over the
    node's GPUs), on the CPU as loaded."""
    if device.type != "cuda":
        return None
    return "auto" if spread else {"": device.index or 0}


def _load_with_peft(
    path: str, model_config: ModelConfig, device: torch.device, *, spread: bool, shards: Shards
) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any
    if shards.sharded and not shards.is_main:
        # Rank 0 reads the weights; the others only build the model's shape, without
        # storage, and receive their shards from it (``Shards.shard``).
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path), dtype=dtype, attn_implementation="sdpa"
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation="sdpa",
            device_map=None if shards.sharded else load_device_map(device, spread=spread),
        )
    if model_config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Seed LoRA's random init (A matrices) without touching the caller's random state.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(LORA_INIT_SEED)
        model = get_peft_model(model, _lora_config(model_config))
    return model, tokenizer


def _check_adapter(directory: Path, *, model_config: ModelConfig, name: str) -> None:
    """Refuse an adapter directory whose files or shape (rank, alpha, target modules) are not
    those of ``model_config``; errors call it ``name``."""
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise TrainingError(
            f"{name} is not a checkpoint directory: it needs {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (the files Trainer.save writes)"
        )
    saved = json.loads(config_path.read_text())
    expected = {
        "r": model_config.lora_rank,
        "lora_alpha": model_config.lora_alpha,
        "target_modules": sorted(model_config.lora_target_modules),
    }
    found = {
        "r": saved.get("r"),
        "lora_alpha": saved.get("lora_alpha"),
        "target_modules": sorted(saved.get("target_modules") or []),
    }
    if found != expected:
        raise TrainingError(
            f"the adapter in {name} was trained with {found}, but the model config "
            f"asks for {expected}: load it with the model config it was trained with"
        )


class Policy:
    """A peft model, its tokenizer, and the forward pass that reads logprobs at row sites."""

    def __init__(
        self,
        model: PeftModel,
        tokenizer: Any,
        *,
        device: torch.device,
        unsloth: bool,
        max_row_tokens: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.uses_unsloth = unsloth
        self.supports_packed_rows = not unsloth
        # The longest row the model takes whole (Unsloth's max_seq_length); None: any.
        self.max_row_tokens = max_row_tokens
        base: Any = model.get_base_model()
        self._decoder = base.get_decoder()
        self._lm_head = base.get_output_embeddings()
        # Every device holding weights (several when spread over the node's GPUs).
        self.devices = tuple(
            sorted({p.device for p in model.parameters()}, key=lambda d: d.index or 0)
        )
        self._softcap = getattr(base.config, "final_logit_softcapping", None)
        # Set by the trainer: refuses rows whose activations would not fit (None: no check).
        self.budget: ActivationBudget | None = None
        # The KL penalty's reference adapter, when a job names one (``set_reference``).
        self.reference_loaded = False

    @classmethod
    def load(
        cls,
        base_model: str,
        *,
        model_config: ModelConfig,
        device: torch.device,
        spread: bool = False,
        shards: Shards = SINGLE,
    ) -> Policy:
        """Load ``base_model`` (through ``hub.resolve_model``) with a fresh, seeded adapter;
        ``spread``: over every GPU of the node (the module docstring).

        A fresh adapter has zero B matrices, so it computes exactly the base model (step 0).
        """
        path = hub.resolve_model(base_model)
        single = not spread and not shards.sharded
        fast = _import_unsloth() if device.type == "cuda" and single else None
        if fast is not None:
            model, tokenizer = _load_with_unsloth(fast, path, model_config, device)
        else:
            model, tokenizer = _load_with_peft(
                path, model_config, device, spread=spread, shards=shards
            )
            # Several ranks: rank 0 loaded it into host memory; each keeps its shard.
            shards.shard(model, device)
        # The adapter names the model as users do, not the local path it was loaded from.
        model.peft_config["default"].base_model_name_or_path = base_model
        return cls(
            model,
            tokenizer,
            device=device,
            unsloth=fast is not None,
            max_row_tokens=model_config.max_seq_length if fast is not None else None,
        )

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: the token ids this model can read."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def drops_out(self) -> bool:
        """Whether a training forward pass draws dropout masks (the adapter's or the base
        model's), so that it computes something else than a pass without gradient would."""
        if any(
            isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0
            for module in self.model.modules()
        ):
            return True
        # Attention dropout is an argument of the attention call, not a module.
        config: Any = self.model.get_base_model().config
        return any(
            isinstance(value, float) and value > 0
            for name, value in config.to_dict().items()
            if name.endswith(("dropout", "pdrop"))
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    # --- the adapter on disk -----------------------------------------------------------------

    def save_adapter(self, directory: Path) -> None:
        """``adapter_config.json`` + ``adapter_model.safetensors``, as peft writes them."""
        # Only the policy's own adapter: never the KL reference loaded beside it.
        self.model.save_pretrained(
            str(directory), save_embedding_layers=False, selected_adapters=[DEFAULT_ADAPTER]
        )
        # peft adds a model card; a checkpoint directory holds only what loading needs.
        (directory / "README.md").unlink(missing_ok=True)

    def load_adapter(self, directory: Path, *, model_config: ModelConfig) -> None:
        """Load adapter weights saved by ``save_adapter`` into this (same-shaped) adapter."""
        _check_adapter(directory, model_config=model_config, name=str(directory))
        result: Any = set_peft_model_state_dict(
            self.model, load_file(str(directory / ADAPTER_WEIGHTS), device=str(self.device))
        )
        if result.unexpected_keys:
            raise TrainingError(
                f"the adapter in {directory} has weights this model has no place for "
                f"({result.unexpected_keys[:3]}...): was it trained on another base model?"
            )

    def set_reference(
        self, directory: Path | None, *, model_config: ModelConfig, name: str = "the reference"
    ) -> None:
        """Load the adapter in ``directory`` (a checkpoint of the same shape) as the KL
        penalty's reference, a second adapter beside the policy's, frozen; None: the base model
        is the reference again. ``name`` is what errors call it (never a host path)."""
        if self.reference_loaded:
            self.model.delete_adapter(REFERENCE_ADAPTER)
            self.reference_loaded = False
        if directory is None:
            return
        _check_adapter(directory, model_config=model_config, name=name)
        try:
            self.model.load_adapter(
                str(directory),
                adapter_name=REFERENCE_ADAPTER,
                is_trainable=False,
                torch_device=str(self.device),
            )
        except (KeyError, RuntimeError, ValueError) as exc:
            raise TrainingError(
                f"{name} does not fit this model's adapter ({type(exc).__name__}): was it "
                "trained on another base model?"
            ) from exc
        self.reference_loaded = True

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The KL penalty's reference policy: the reference adapter (``set_reference``), else
        the base model. The policy's adapter is active again afterwards, trainable as before
        (peft's ``set_adapter`` sets which adapter's weights require a gradient)."""
        if not self.reference_loaded:
            with self.adapter_disabled():
                yield
            return
        self.model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield
        finally:
            self.model.set_adapter(DEFAULT_ADAPTER)

    # --- forward -----------------------------------------------------------------------------

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden)
        if self._softcap:
            logits = self._softcap * torch.tanh(logits / self._softcap)
        return logits

    def _attention_mask(self, row: PackedRow) -> torch.Tensor:
        """``(1, 1, L, L)``: causal, and within a token's own segment or its shared prefix."""
        segment = torch.tensor(row.segment_ids, device=self.device)
        parent = torch.tensor(row.parent_ids, device=self.device)
        same_block = (segment[None, :] == segment[:, None]) | (segment[None, :] == parent[:, None])
        causal = torch.ones(len(row), len(row), dtype=torch.bool, device=self.device).tril()
        allowed = (same_block & causal)[None, None]
        if self.model.config._attn_implementation == "eager":
            blocked = torch.finfo(self.model.dtype).min
            return torch.zeros(
                allowed.shape, dtype=self.model.dtype, device=self.device
            ).masked_fill(~allowed, blocked)
        return allowed

    def hidden_states(self, row: PackedRow) -> torch.Tensor:
        """The final hidden states of every position of ``row``, ``(L, H)``."""
        input_ids = torch.tensor([row.input_ids], device=self.device)
        if row.is_plain:
            output = self._decoder(input_ids=input_ids, use_cache=False)
        elif not self.supports_packed_rows:
            raise TrainingError("this model cannot run packed rows; pack one sequence per row")
        else:
            output = self._decoder(
                input_ids=input_ids,
                attention_mask=self._attention_mask(row),
                position_ids=torch.tensor([row.position_ids], device=self.device),
                use_cache=False,
            )
        hidden: torch.Tensor = output.last_hidden_state[0]
        return hidden

    def site_logprobs(
        self, row: PackedRow, *, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs (with gradient, if enabled) and entropies at the row's prediction sites."""
        if self.budget is not None and torch.is_grad_enabled():
            self.budget.check(row_tokens=len(row), chunk_size=chunk_size, packed=not row.is_plain)
        hidden = self.hidden_states(row)
        # Spread over GPUs, the last layer and the output layer may sit on other devices.
        sources = torch.tensor(row.source_positions, device=hidden.device)
        targets = torch.tensor(row.target_ids, device=self._lm_head.weight.device)
        logprobs, entropies = token_logprobs(
            hidden[sources], targets, head=self._head, chunk_size=chunk_size
        )
        return logprobs.to(self.device), entropies.to(self.device)

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The base model, for the KL penalty's reference logprobs."""
        with self.model.disable_adapter():
            yield
