"""The GRPO loss as small pure tensor functions, with ART's options.

Every tensor here is flat over *prediction sites* (trained tokens), shape ``(N,)``: the packed
rows already dropped everything that is not trained. One step's loss is the sum of the per-token
losses, each times its token's weight, divided by the number of trained tokens in the step
(however many rows it spans). The weights are 1 (a token mean) unless the job aggregates as ART
does (``advantages.art_weights``: each trajectory weighs the same).

The importance ratio of a token, ``pi / pi_old``, is taken at ART's four levels (token,
sequence, their average or geometric average), its log clamped to +-20 as ART does; ART's
options then act on it in ART's order: a cap
(``max_negative_advantage_importance_sampling_weight``), the mask of ratios outside the clip
range (``mask_prob_ratio``), Kimi K2's advantage correction (``kimi_k2_tau``) and ART's KL
shaping of the advantages (``art_kl_advantages``), before the PPO or CISPO loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

LOSS_FUNCTIONS = ("ppo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "average", "geometric_average")
# exp() of a larger log ratio overflows half precision; ART clamps there too (art/loss.py).
LOG_RATIO_BOUND = 20.0


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


def sequence_mean(values: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Each token's value replaced by the mean over its sequence (``sequence_ids`` (N,)),
    differentiable: every token of a sequence carries the sequence's gradient."""
    num_sequences = int(sequence_ids.max().item()) + 1 if sequence_ids.numel() else 0
    sums = values.new_zeros(num_sequences).index_add(0, sequence_ids, values)
    counts = torch.bincount(sequence_ids, minlength=num_sequences).clamp(min=1)
    return (sums / counts)[sequence_ids]


def importance_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    level: str,
) -> torch.Tensor:
    """pi / pi_old per token, as ART defines each level.

    ``token``: exp(log pi - log pi_old) of the token. ``sequence`` (GSPO): exp of the mean log
    ratio over the token's sequence, its gradient flowing to every token of the sequence.
    ``average``: the mean of the two; ``geometric_average``: the square root of their product.
    Log ratios are clamped to +-``LOG_RATIO_BOUND`` before exp.
    """
    log_ratio = logprobs - old_logprobs
    token = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if level == "token":
        return token
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        allowed = ", ".join(repr(name) for name in IMPORTANCE_SAMPLING_LEVELS)
        raise ValueError(f"importance_sampling_level must be one of {allowed}, got {level!r}")
    sequence_log_ratio = sequence_mean(log_ratio, sequence_ids)
    sequence = torch.exp(sequence_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if level == "sequence":
        return sequence
    if level == "average":
        return (token + sequence) / 2
    return token.sqrt() * sequence.sqrt()


def capped_ratio(ratio: torch.Tensor, cap: float | None) -> torch.Tensor:
    """ART's ``max_negative_advantage_importance_sampling_weight``: the ratio, at most ``cap``.

    Under PPO's min this binds only where the advantage is negative (a positive one is
    clipped at ``1 + epsilon_high`` anyway); None or 0 leaves the ratio as it is.
    """
    return ratio.clamp(max=cap) if cap else ratio


def masked_ratio(ratio: torch.Tensor, *, epsilon: float, epsilon_high: float) -> torch.Tensor:
    """ART's ``mask_prob_ratio``: a ratio outside (1 - epsilon, 1 + epsilon_high) becomes 0."""
    inside = (ratio > 1 - epsilon) & (ratio < 1 + epsilon_high)
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    *,
    cap: float,
) -> torch.Tensor:
    """ART's ``truncated_importance_sampling``: with the old policy the trainer's own
    (``precalculate_logprobs``), each token's loss is also weighed by pi_old / pi_sampler, at
    most ``cap`` (no gradient). A token the sampler gave no logprob for counts as sampled by
    the current policy."""
    sampled = torch.where(sampled_logprobs.isnan(), current_logprobs, sampled_logprobs)
    return torch.exp(old_logprobs - sampled).clamp(max=cap).detach()


def kimi_k2_advantages(
    advantages: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor, *, tau: float
) -> torch.Tensor:
    """ART's ``kimi_k2_tau``: each token's advantage minus tau * log(pi / pi_old) (no gradient)."""
    return advantages - tau * (logprobs - old_logprobs).detach()


def art_kl_advantages(
    advantages: torch.Tensor,
    source_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    *,
    mean_kl: float,
    coef: float,
) -> torch.Tensor:
    """ART's KL penalty, which shapes the advantages instead of adding a loss term: each
    token's advantage plus ``coef * (mean_kl - kl)`` with kl = log pi_source - log pi_ref
    (no gradient), ``mean_kl`` its mean over the step's tokens. Tokens the policy drifted
    further from the reference than average are discouraged, the others encouraged."""
    kl = (source_logprobs - reference_logprobs).detach()
    return advantages + coef * (mean_kl - kl)


def ppo_loss(
    ratio: torch.Tensor,
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
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo_loss(
    ratio: torch.Tensor,
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
    weight = ratio.detach().clamp(1 - epsilon, 1 + epsilon_high)
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
    ratio: torch.Tensor, advantages: torch.Tensor, *, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, whether the lower / upper clip bound is the active one (as floats 0/1)."""
    ratio = ratio.detach()
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return low.float(), high.float()


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate k3 = exp(d) - d - 1 with d = log pi_ref - log pi.

    Non-negative, unbiased for samples from pi, and zero where the policy equals the reference.
    """
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def token_mean(
    per_token: torch.Tensor, num_tokens: int, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum over these tokens (each times its weight, if given) divided by the step's trained
    token count: the rows of a step add up to its loss."""
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum() / max(num_tokens, 1)
