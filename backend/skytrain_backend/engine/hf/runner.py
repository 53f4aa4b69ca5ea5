"""The base model, its LoRA adapters and the forward pass, as the engine thread drives them.

Adapters are injected with peft and kept side by side; a batch mixes them freely, each row
naming its adapter (peft's ``adapter_names``, ``"__base__"`` for the base model). Every
adapter's config and weights are also kept in memory (they are small), so ``release`` can drop
the model entirely and ``restore`` rebuilds it, adapters included, even if the directories
they came from are gone.

Only the engine thread calls into a runner: peft mutates modules in place, which must never
happen during a forward pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from skytrain_backend.errors import ConfigurationError, InvalidRequest

logger = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AdapterWeights:
    config: LoraConfig
    state_dict: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PromptTokenLogprob:
    """A prompt token's logprob given the tokens before it, its rank among the vocabulary
    (1: the most likely), and the most likely (token id, logprob) pairs at its position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


# Prompt positions scored at a time: a (chunk, vocabulary) block of logits is all it holds.
SCORE_CHUNK = 256


def read_adapter(path: str) -> AdapterWeights:
    """A LoRA adapter saved by peft's ``save_pretrained``; InvalidRequest says what is wrong."""
    directory = Path(path)
    if not (directory / "adapter_config.json").is_file():
        raise InvalidRequest(
            f"no LoRA adapter at {path!r}: expected a directory with adapter_config.json and "
            "adapter_model.safetensors (peft's save_pretrained)"
        )
    try:
        config = PeftConfig.from_pretrained(str(directory))
        state_dict = load_peft_weights(str(directory), device="cpu")
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InvalidRequest(f"cannot read the LoRA adapter at {path!r}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        raise InvalidRequest(
            f"the adapter at {path!r} is a {type(config).__name__}; only LoRA adapters are served"
        )
    config.inference_mode = True
    return AdapterWeights(config=config, state_dict=state_dict)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    """``auto`` is float32 on CPU (fast and exact there) and the checkpoint's dtype on GPUs."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    if dtype not in DTYPES:
        raise ConfigurationError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _return_freed_memory_to_os() -> None:
    libc = ctypes.util.find_library("c")
    if libc is not None:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def _rows_laid_out_alike(hidden_U1H: torch.Tensor, rows_B: torch.Tensor) -> torch.Tensor:
    """Rows ``rows_B`` of the last hidden states the model hands its output layer, in the
    memory layout the model would have handed over for B rows: a view of the last position
    of a (B, T, H) tensor. MKL can round a product of such a strided view differently from
    one of the same numbers packed densely."""
    per_row = hidden_U1H.stride(0)
    storage = hidden_U1H.new_empty(len(rows_B) * per_row)
    hidden_B1H = storage.as_strided(
        (len(rows_B), *hidden_U1H.shape[1:]),
        hidden_U1H.stride(),
        hidden_U1H.storage_offset() % per_row,
    )
    return hidden_B1H.copy_(hidden_U1H[rows_B])


class ModelRunner:
    def __init__(self, model_path: str, *, dtype: str = "auto", device: str | None = None) -> None:
        self.model_path = model_path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.config = AutoConfig.from_pretrained(model_path)
        self.model: Any = None
        self._adapters: dict[str, AdapterWeights] = {}
        self.restore()

    @property
    def is_released(self) -> bool:
        return self.model is None

    def eos_token_ids(self) -> frozenset[int]:
        """Every id the checkpoint calls end-of-sequence (tokenizer, model and generation config)."""
        ids: set[int] = set()
        sources = [self.tokenizer.eos_token_id, self.config.eos_token_id]
        if self.model is not None and self.model.generation_config is not None:
            sources.append(self.model.generation_config.eos_token_id)
        for source in sources:
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(source)
        return frozenset(ids)

    def max_position_embeddings(self) -> int | None:
        value = getattr(self.config, "max_position_embeddings", None)
        return value if isinstance(value, int) else None

    # --- memory ---------------------------------------------------------------------------------

    def release(self) -> None:
        """Drop the weights (and with them every cache tensor); adapters stay in memory."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _return_freed_memory_to_os()

    def restore(self) -> None:
        """Load the base weights and re-inject every adapter."""
        if self.model is not None:
            return
        logger.info("loading %s (%s on %s)", self.model_path, self.dtype, self.device)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype)
        self.model = model.to(self.device)
        self.model.eval()
        for name, adapter in self._adapters.items():
            self._inject(name, adapter)

    # --- adapters -------------------------------------------------------------------------------

    def add_adapter(self, name: str, adapter: AdapterWeights) -> None:
        """Inject an adapter under an internal ``name``; a misfit raises InvalidRequest."""
        self._inject(name, adapter)
        self._adapters[name] = adapter

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)
        if self.model is not None:
            self._eject(name)

    def _inject(self, name: str, adapter: AdapterWeights) -> None:
        try:
            if isinstance(self.model, PeftModel):
                self.model.add_adapter(name, adapter.config)
            else:
                self.model = get_peft_model(self.model, adapter.config, adapter_name=name)
            result: Any = set_peft_model_state_dict(
                self.model, adapter.state_dict, adapter_name=name
            )
            missing = [key for key in result.missing_keys if f".{name}." in key]
            if result.unexpected_keys or missing:
                raise ValueError(
                    f"its weights do not match its config on this model "
                    f"(unexpected: {result.unexpected_keys[:3]}, missing: {missing[:3]})"
                )
        except (ValueError, RuntimeError, KeyError) as exc:
            self._eject(name)
            raise InvalidRequest(
                f"the LoRA adapter does not fit the base model {self.model_path}: {exc}"
            ) from exc
        self.model.eval()

    def _eject(self, name: str) -> None:
        if not isinstance(self.model, PeftModel) or name not in self.model.peft_config:
            return
        if len(self.model.peft_config) == 1:
            # peft cannot run with no adapter at all: go back to the plain base model.
            self.model = self.model.unload()
        else:
            self.model.delete_adapter(name)

    # --- forward --------------------------------------------------------------------------------

    def can_expand_rows(self) -> bool:
        """Whether ``forward`` can compute one row for several sequences (``rows_B``): the
        output layer is a plain linear layer, shared by every adapter (an adapter that trains
        it, LoRA on ``lm_head`` or ``modules_to_save``, wraps it in a module of its own)."""
        return isinstance(self.model.get_output_embeddings(), torch.nn.Linear)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BL: torch.Tensor,
        position_ids_BT: torch.Tensor,
        cache: DynamicCache | None,
        adapters: list[str | None],
        *,
        rows_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Logits of the last position of every row (float32, (B, V)) and the grown cache.

        With ``rows_B`` (only where ``can_expand_rows``), output row ``i`` is input row
        ``rows_B[i]``'s: identical prompts are run once, and each sequence gets a copy of its
        prompt's cache. The output layer still runs on all B last hidden states, as on a
        batch of B separate rows. The logits and cache are then bitwise those of the B rows
        run separately wherever a matrix product gives a row the same result however many
        rows it is computed with: MKL on one thread does from 4 rows on, and the prompts'
        positions are many rows, but the last positions of a batch can be as few as 2.
        Elsewhere (MKL on several threads, below 12 rows; one thread on an Intel Xeon seen
        2026-12-05, by about 1e-5 of a logprob for SmolLM2) they differ by rounding, as they
        do with what else is in the batch.
        """
        kwargs: dict[str, Any] = {}
        if isinstance(self.model, PeftModel):
            kwargs["adapter_names"] = [adapter or BASE_ADAPTER for adapter in adapters]
        expand = None
        if rows_B is not None:
            rows = rows_B.to(self.device)
            expand = self.model.get_output_embeddings().register_forward_pre_hook(
                lambda _module, args: (_rows_laid_out_alike(args[0], rows), *args[1:])
            )
        try:
            output = self.model(
                input_ids=input_ids_BT.to(self.device),
                attention_mask=attention_mask_BL.to(self.device),
                position_ids=position_ids_BT.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        finally:
            if expand is not None:
                expand.remove()
        if rows_B is not None:
            output.past_key_values.batch_select_indices(rows)
        return output.logits[:, -1, :].float(), output.past_key_values

    def score_prompt(
        self, input_ids: list[int], adapter: str | None, *, k: int
    ) -> list[PromptTokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it, its rank, and the ``k``
        most likely tokens at its position (None for the first token, which has no context):
        one forward pass of the whole prompt, without a cache, its output layer run
        ``SCORE_CHUNK`` positions at a time (a long prompt's (T, V) logits never exist)."""
        kwargs: dict[str, Any] = {}
        if isinstance(self.model, PeftModel):
            kwargs["adapter_names"] = [adapter or BASE_ADAPTER]
        ids_1T = torch.tensor([input_ids], device=self.device)
        head = self.model.get_output_embeddings()
        captured: list[torch.Tensor] = []

        def keep_hidden(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            # The final hidden states of every position; the model's own output layer then
            # runs on the last one only.
            captured.append(args[0])
            return (args[0][:, -1:], *args[1:])

        chunked = self._plain_output_layer()
        hook = head.register_forward_pre_hook(keep_hidden) if chunked else None
        scored: list[PromptTokenLogprob | None] = [None]
        with torch.inference_mode():
            try:
                output = self.model(
                    input_ids=ids_1T,
                    attention_mask=torch.ones_like(ids_1T),
                    use_cache=False,
                    logits_to_keep=0,
                    **kwargs,
                )
            finally:
                if hook is not None:
                    hook.remove()
            hidden_TH = captured[0][0, :-1] if chunked else output.logits[0, :-1]
            for start in range(0, hidden_TH.shape[0], SCORE_CHUNK):
                block = hidden_TH[start : start + SCORE_CHUNK]
                logprobs_CV = (head(block) if chunked else block).float().log_softmax(dim=-1)
                targets = ids_1T[0, 1 + start : 1 + start + block.shape[0]]
                chosen_C = logprobs_CV.gather(-1, targets[:, None])[:, 0]
                ranks_C = (logprobs_CV > chosen_C[:, None]).sum(dim=-1) + 1
                values_CK, ids_CK = logprobs_CV.topk(k, dim=-1)
                for token, logprob, rank, ids, values in zip(
                    targets.tolist(),
                    chosen_C.tolist(),
                    ranks_C.tolist(),
                    ids_CK.tolist(),
                    values_CK.tolist(),
                    strict=True,
                ):
                    top = list(zip(ids, values, strict=True))
                    scored.append(PromptTokenLogprob(token, logprob, rank, top))
        return scored

    def _plain_output_layer(self) -> bool:
        """Whether the logits are the output layer's product and nothing more (no LoRA on
        it, no soft-capping or scaling after it), so it can be run on chunks of positions."""
        config = getattr(self.model, "config", None)
        after = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
        return self.can_expand_rows() and not any(getattr(config, name, None) for name in after)
