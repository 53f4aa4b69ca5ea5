"""Tinker's training primitives on a LoRA policy: forward, forward-backward with a named loss,
the Adam step, and loading saved weights into a live trainer.

A Tinker client owns the algorithm; these functions only run what it names, on the ``Trainer``
(policy + AdamW optimizer + step) that ``Trainer.load`` builds and ``Trainer.save`` writes as an
ordinary checkpoint directory.

Every tensor is one value per model-input token, shape ``(N,)``: position ``i`` of the input
predicts ``target_tokens[i]``, and the loss functions below turn the policy's logprobs of those
targets (``logprobs``, with gradient) and the datum's other inputs into a per-token loss. The
datum's loss is their *sum* (Tinker's convention: weights or advantages carry any scaling), and
``forward_backward`` adds each datum's gradient to what the parameters hold already, so
gradients accumulate over calls until ``adam_step`` applies and clears them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol.tinker_api import AdamParams
from skytrain_backend.trainer.model import Policy
from skytrain_backend.trainer.packing import PackedRow
from skytrain_backend.trainer.trainer import OPTIMIZER_STATE, TRAINER_STATE, Trainer

# Tokens per output-layer chunk: the (chunk, vocabulary) logits block is all memory holds.
LOGPROB_CHUNK_SIZE = 1024
# Datums packed into one forward pass, up to this many tokens (the attention mask is L x L).
ROW_TOKENS = 4096

Inputs = dict[str, torch.Tensor]
LossFunction = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]


# --- losses: per-token, from the policy's target logprobs ---------------------------------------


def cross_entropy(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """``-logprobs * weights`` (weights default to one)."""
    weights = inputs.get("weights")
    return -logprobs if weights is None else -logprobs * weights


def _ratio(logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """The importance ratio of the learner to the sampler, ``p / q``."""
    return torch.exp(logprobs - inputs["logprobs"])


def importance_sampling(
    logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]
) -> torch.Tensor:
    """REINFORCE corrected for off-policy samples: ``-(p / q) * advantage``."""
    return -_ratio(logprobs, inputs) * inputs["advantages"]


def ppo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """The clipped surrogate: the lesser of the plain and the clipped ratio's objective."""
    ratio = _ratio(logprobs, inputs)
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """The clipped ratio as a constant weight on the policy gradient of each token."""
    clipped = _ratio(logprobs, inputs).clamp(
        config["clip_low_threshold"], config["clip_high_threshold"]
    )
    return -clipped.detach() * logprobs * inputs["advantages"]


def dro(logprobs: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """The policy gradient with a quadratic penalty on the log ratio, weighted by ``beta``."""
    log_ratio = logprobs - inputs["logprobs"]
    return -(logprobs * inputs["advantages"] - 0.5 * config["beta"] * log_ratio**2)


LOSS_FUNCTIONS: dict[str, LossFunction] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


# --- forward and backward -----------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One datum: the model input's token ids and its per-token loss inputs."""

    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]


def _vocabulary_size(policy: Policy) -> int:
    base: Any = policy.model.get_base_model()
    return int(base.get_output_embeddings().weight.shape[0])


def check_examples(policy: Policy, examples: Sequence[Example]) -> None:
    """Token ids the model has no row for fail here, before any gradient is touched."""
    vocabulary = _vocabulary_size(policy)
    for index, example in enumerate(examples):
        largest = max([*example.tokens, *example.inputs["target_tokens"]])
        if largest >= vocabulary:
            raise TrainingError(
                f"data[{index}] has token id {int(largest)}, outside the model's vocabulary "
                f"(0..{vocabulary - 1})"
            )


def pack_examples(
    examples: Sequence[Example], *, row_tokens: int, packed: bool
) -> list[tuple[PackedRow, list[int]]]:
    """Rows of whole datums, each row with the indices of the datums it holds in order.

    With ``packed``, datums share a row (up to ``row_tokens`` tokens; a longer datum has a row
    of its own): each is a segment of its own, attending only to itself, its positions from 0,
    so it is computed as if alone, in one forward pass for many short datums.
    """
    rows: list[tuple[PackedRow, list[int]]] = []
    for index, example in enumerate(examples):
        n = len(example.tokens)
        row = rows[-1][0] if rows else None
        if row is None or not packed or len(row) + n > row_tokens:
            row = PackedRow()
            rows.append((row, []))
        segment = len(rows[-1][1])
        offset = len(row)
        row.input_ids += list(example.tokens)
        row.position_ids += list(range(n))
        row.segment_ids += [segment] * n
        row.parent_ids += [segment] * n
        row.source_positions += list(range(offset, offset + n))
        row.target_ids += [int(token) for token in example.inputs["target_tokens"]]
        rows[-1][1].append(index)
    return rows


def forward_backward(
    policy: Policy,
    examples: Sequence[Example],
    *,
    loss_fn: str,
    config: dict[str, float],
    backward: bool,
) -> tuple[list[list[float]], dict[str, float]]:
    """Each datum's target logprobs and the summed loss (``loss:sum``); with ``backward``,
    the loss's gradient is added to the parameters' ``.grad``."""
    loss_function = LOSS_FUNCTIONS[loss_fn]
    check_examples(policy, examples)
    policy.model.train(backward)
    outputs: list[list[float]] = [[] for _ in examples]
    total = 0.0
    rows = pack_examples(examples, row_tokens=ROW_TOKENS, packed=policy.supports_packed_rows)
    with torch.set_grad_enabled(backward):
        for row, indices in rows:
            logprobs, _ = policy.site_logprobs(row, chunk_size=LOGPROB_CHUNK_SIZE)  # (L,)
            # Each datum's loss from its own inputs: datums sharing a row may name different
            # optional inputs (one with weights, one without).
            losses = []
            start = 0
            for i in indices:
                end = start + len(examples[i].tokens)
                inputs = {
                    name: torch.tensor(values, dtype=torch.float32, device=policy.device)
                    for name, values in examples[i].inputs.items()
                    if name != "target_tokens"
                }
                losses.append(loss_function(logprobs[start:end], inputs, config).sum())
                start = end
            loss = torch.stack(losses).sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
            values = logprobs.detach().float().cpu().tolist()
            start = 0
            for i in indices:
                outputs[i] = values[start : start + len(examples[i].tokens)]
                start += len(examples[i].tokens)
    return outputs, {"loss:sum": total}


def has_gradients(trainer: Trainer) -> bool:
    return any(p.grad is not None for p in trainer.policy.trainable_parameters())


# --- the optimizer ------------------------------------------------------------------------------


def adam_step(trainer: Trainer, params: AdamParams) -> dict[str, float]:
    """Apply the accumulated gradients with AdamW, then clear them; ``trainer.step`` + 1."""
    grad_norm = trainer.optimizer_step(
        learning_rate=params.learning_rate,
        weight_decay=params.weight_decay,
        max_grad_norm=params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf,
        adam_beta1=params.beta1,
        adam_beta2=params.beta2,
        eps=params.eps,
    )
    trainer.step += 1
    return {"grad_norm": grad_norm, "learning_rate": params.learning_rate}


# --- weights ------------------------------------------------------------------------------------


def reseed_adapter(trainer: Trainer, seed: int) -> None:
    """Initialize a fresh adapter from ``seed`` (A matrices random, B matrices zero)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in trainer.policy.model.modules():
            reset = getattr(module, "reset_lora_parameters", None)
            if reset is not None and "default" in getattr(module, "lora_A", {}):
                reset("default", True)


def load_weights(trainer: Trainer, directory: Path, *, with_optimizer: bool) -> None:
    """Put a checkpoint directory's adapter (and optimizer state) into a live trainer.

    Without the optimizer, Adam starts afresh, as for a new model. Gradients not yet applied
    are dropped either way.
    """
    trainer.policy.load_adapter(directory, model_config=trainer.model_config)
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=0.0)
    trainer.optimizer.zero_grad(set_to_none=True)
    state_path = directory / TRAINER_STATE
    trainer.step = (
        int(json.loads(state_path.read_text()).get("step", 0)) if state_path.is_file() else 0
    )
    optimizer_path = directory / OPTIMIZER_STATE
    if with_optimizer and optimizer_path.is_file():
        trainer.load_optimizer(optimizer_path)
