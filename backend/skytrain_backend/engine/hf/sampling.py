"""Choosing the next token of every sequence in a batch, each with its own parameters.

Logprobs are those of the model's raw distribution (``log_softmax`` of the logits, before
temperature, top-k and top-p), which is what vLLM returns by default and what the trainer
recomputes: the sampling logprob of a token is comparable with the policy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is decoded (a request with ``n`` > 1 has ``n`` sequences)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens.
    num_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filter_top_k_top_p(
    logits_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus (k <= 0: no top-k)."""
    sorted_logits, order = logits_BV.sort(dim=-1, descending=True)
    vocab = logits_BV.shape[-1]
    ranks = torch.arange(vocab, device=logits_BV.device).expand_as(sorted_logits)
    k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, vocab))
    outside = ranks >= k_B[:, None]
    sorted_probs = sorted_logits.masked_fill(outside, float("-inf")).softmax(dim=-1)
    # A token stays if the probability mass before it is below top_p (the first always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside |= mass_before > top_p_B[:, None]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits_BV).scatter_(-1, order, sorted_logits)


def sample_next_tokens(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """One token id per row: argmax for greedy rows, a draw from each row's generator otherwise."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) < len(params):
        tokens_B = logits_BV.argmax(dim=-1)
        if not rows:
            return tokens_B
    else:
        tokens_B = torch.empty(len(params), dtype=torch.long, device=logits_BV.device)
    index = torch.tensor(rows, device=logits_BV.device)
    # The usual batch samples every row at temperature 1: it needs no copy of its rows, and
    # no division (x / 1 is x exactly), each a pass over the vocabulary of every row.
    scaled = logits_BV if len(rows) == len(params) else logits_BV[index]
    if any(params[i].temperature != 1.0 for i in rows):
        temperature = torch.tensor([params[i].temperature for i in rows], device=logits_BV.device)
        scaled = scaled / temperature[:, None]
    if any(params[i].top_p < 1.0 or params[i].top_k > 0 for i in rows):
        top_k = torch.tensor([params[i].top_k for i in rows], device=logits_BV.device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits_BV.device)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    # Inverse transform sampling: one uniform draw per row from the row's own generator, then
    # one vectorized search of the cumulative distributions. (torch.multinomial, called row
    # by row for the generators' sake, cost milliseconds per row over a large vocabulary: the
    # bulk of a step's time for a big batch of a small model.)
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    uniforms = torch.cat(
        [torch.rand(1, generator=generators[i], device=generators[i].device) for i in rows]
    )
    targets = uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1]
    # "right": the first token whose cumulative probability exceeds the draw, which always
    # has a probability above zero (filtered tokens add nothing to the sum).
    drawn = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0]
    # A draw rounded up to the very total falls past the end: take the row's top token.
    past_end = drawn >= cdf.shape[-1]
    if past_end.any():
        drawn = torch.where(past_end, scaled.argmax(dim=-1), drawn)
    tokens_B[index] = drawn
    return tokens_B


def gather_logprobs(
    logprobs_BV: torch.Tensor, tokens_B: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each row's logprob of its token, and its k most likely (token id, logprob) pairs."""
    chosen = logprobs_BV.gather(-1, tokens_B[:, None])[:, 0].tolist()
    if k == 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs_BV.topk(k, dim=-1)
    top = [
        list(zip(row_ids, row_values, strict=True))
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]
    return chosen, top
