"""The GRPO loss as small pure tensor functions.

Every tensor here is flat over *prediction sites* (trained tokens), shape ``(N,)``: the packed
rows already dropped everything that is not trained. One step's loss is the sum of the per-token
losses divided by the number of trained tokens in the step (a token mean over the whole step,
however many rows it spans).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

LOSS_FUNCTIONS = ("ppo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _logprobs_and_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # (n, V)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - log_normalizer
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = log_normalizer - (probs * logits).sum(-1)
    return logprobs, entropy


def token_logprobs(
    hidden: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``target_ids`` and the entropy of each predicted distribution.

    ``hidden`` is ``(N, H)``, the final hidden states at the prediction sites; ``head`` maps them
    to logits. The ``(N, V)`` fp32 logits are never materialized at once: sites are processed
    ``chunk_size`` at a time, and while gradients are on each chunk is recomputed in the
    backward pass instead of kept, so memory holds one ``(chunk_size, V)`` block. Entropy is
    reported, never differentiated.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        chunk = hidden[start : start + chunk_size]
        targets = target_ids[start : start + chunk_size]
        if torch.is_grad_enabled():
            logprob, entropy = checkpoint(
                _logprobs_and_entropy, head, chunk, targets, use_reentrant=False
            )
        else:
            logprob, entropy = _logprobs_and_entropy(head, chunk, targets)
        logprobs.append(logprob)
        entropies.append(entropy)
    if not logprobs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def importance_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    level: str,
) -> torch.Tensor:
    """log(pi / pi_old) per token, at token level or sequence level (GSPO).

    Sequence level gives every token of a sequence the sequence's mean log ratio as its value,
    while each token's gradient stays its own logprob's: d/dθ = ratio * d log pi(token).
    ``sequence_ids`` (N,) numbers the sequences the tokens belong to.
    """
    token_log_ratio = logprobs - old_logprobs
    if level == "token":
        return token_log_ratio
    if level == "sequence":
        num_sequences = int(sequence_ids.max().item()) + 1 if sequence_ids.numel() else 0
        sums = torch.zeros(num_sequences, dtype=logprobs.dtype, device=logprobs.device)
        sums = sums.index_add(0, sequence_ids, token_log_ratio.detach())
        counts = torch.bincount(sequence_ids, minlength=num_sequences).clamp(min=1)
        sequence_mean = (sums / counts)[sequence_ids]
        return sequence_mean + logprobs - logprobs.detach()
    allowed = ", ".join(repr(name) for name in IMPORTANCE_SAMPLING_LEVELS)
    raise ValueError(f"importance_sampling_level must be one of {allowed}, got {level!r}")


def ppo_loss(
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
) -> torch.Tensor:
    """PPO's clipped surrogate: -min(r A, clip(r, 1 - eps, 1 + eps_high) A) per token.

    ``logprobs`` is unused (the ratio carries the gradient); it keeps one signature for all
    loss functions.
    """
    del logprobs
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo_loss(
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
) -> torch.Tensor:
    """CISPO: -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi per token.

    The importance weight is clipped and detached instead of the update being dropped, so
    tokens far off-policy still get a (bounded) gradient.
    """
    weight = torch.exp(log_ratio).clamp(1 - epsilon, 1 + epsilon_high).detach()
    return -weight * advantages * logprobs


def policy_loss_function(name: str) -> Callable[..., torch.Tensor]:
    """The per-token loss named by ``RLTrainConfig.loss_fn``."""
    if name == "ppo":
        return ppo_loss
    if name == "cispo":
        return cispo_loss
    allowed = ", ".join(repr(option) for option in LOSS_FUNCTIONS)
    raise ValueError(f"loss_fn must be one of {allowed}, got {name!r}")


def clipped_fractions(
    log_ratio: torch.Tensor, advantages: torch.Tensor, *, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, whether the lower / upper clip bound is the active one (as floats 0/1)."""
    ratio = torch.exp(log_ratio.detach())
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return low.float(), high.float()


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate k3 = exp(d) - d - 1 with d = log pi_ref - log pi.

    Non-negative, unbiased for samples from pi, and zero where the policy equals the reference.
    """
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def token_mean(per_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum over these tokens divided by the step's trained token count (rows add up to a mean)."""
    return per_token.sum() / max(num_tokens, 1)
