"""The loss functions against direct, unoptimized reference implementations (values + grads)."""

from __future__ import annotations

import math

import pytest
import torch

from skytrain_backend.trainer.loss import (
    cispo_loss,
    clipped_fractions,
    importance_log_ratio,
    kl_penalty,
    policy_loss_function,
    ppo_loss,
    token_logprobs,
    token_mean,
)

EPSILON, EPSILON_HIGH = 0.2, 0.28


def _reference_loss(
    name: str,
    level: str,
    logprobs: list[torch.Tensor],
    old_logprobs: list[float],
    advantages: list[float],
    sequence_ids: list[int],
) -> torch.Tensor:
    """Token by token, as the papers write it: PPO / CISPO, token or sequence (GSPO) ratios."""
    total = torch.zeros((), dtype=torch.float64)
    for i, logprob in enumerate(logprobs):
        if level == "token":
            ratio = torch.exp(logprob - old_logprobs[i])
        else:
            members = [j for j, s in enumerate(sequence_ids) if s == sequence_ids[i]]
            mean_log_ratio = sum(logprobs[j].item() - old_logprobs[j] for j in members) / len(
                members
            )
            # value: the sequence ratio; gradient: ratio * d log pi(token)
            ratio = math.exp(mean_log_ratio) * torch.exp(logprob - logprob.detach())
        advantage = advantages[i]
        if name == "ppo":
            clipped = torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON_HIGH)
            total = total - torch.min(ratio * advantage, clipped * advantage)
        else:
            weight = min(max(ratio.item(), 1 - EPSILON), 1 + EPSILON_HIGH)
            total = total - weight * advantage * logprob
    return total / len(logprobs)


@pytest.mark.parametrize("name", ["ppo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_matches_reference_values_and_gradients(name: str, level: str) -> None:
    generator = torch.Generator().manual_seed(7)
    n = 40
    logprobs = (-torch.rand(n, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    # Old logprobs spread enough that many ratios fall outside [1 - eps, 1 + eps_high].
    old = logprobs.detach() + torch.randn(n, generator=generator, dtype=torch.float64) * 0.4
    advantages = torch.randn(n, generator=generator, dtype=torch.float64)
    sequence_ids = torch.randint(0, 5, (n,), generator=generator)

    log_ratio = importance_log_ratio(logprobs, old, sequence_ids, level=level)
    loss = token_mean(
        policy_loss_function(name)(
            log_ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH
        ),
        n,
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)

    reference_inputs = [logprobs.detach()[i].clone().requires_grad_() for i in range(n)]
    reference = _reference_loss(
        name, level, reference_inputs, old.tolist(), advantages.tolist(), sequence_ids.tolist()
    )
    reference.backward()
    reference_gradient = torch.stack([x.grad for x in reference_inputs])  # type: ignore[misc]

    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(gradient, reference_gradient)


def test_ppo_clipped_tokens_get_no_gradient_and_are_counted() -> None:
    logprobs = torch.zeros(4, requires_grad=True)
    # ratios: 2.0 (A > 0: above 1 + eps_high, clipped), 0.5 (A < 0: below 1 - eps, clipped),
    # 2.0 with A < 0 and 0.5 with A > 0 (the unclipped side of min: gradient flows).
    old = torch.log(torch.tensor([0.5, 2.0, 0.5, 2.0]))
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    log_ratio = importance_log_ratio(logprobs, old, torch.zeros(4, dtype=torch.long), level="token")
    loss = ppo_loss(log_ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    loss.sum().backward()

    assert logprobs.grad is not None
    assert logprobs.grad[:2].tolist() == [0.0, 0.0]
    assert logprobs.grad[2:].abs().min() > 0
    # the clipped tokens' loss is the clipped ratio times the advantage
    assert loss[0].item() == pytest.approx(-(1 + EPSILON_HIGH))
    assert loss[1].item() == pytest.approx(1 - EPSILON)
    low, high = clipped_fractions(log_ratio, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    assert low.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert high.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_cispo_keeps_a_bounded_gradient_where_ppo_clips() -> None:
    logprobs = torch.zeros(1, requires_grad=True)
    old = torch.log(torch.tensor([0.5]))  # ratio 2
    advantages = torch.tensor([1.0])
    log_ratio = importance_log_ratio(logprobs, old, torch.zeros(1, dtype=torch.long), level="token")
    cispo_loss(
        log_ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH
    ).backward()
    assert logprobs.grad is not None
    assert logprobs.grad.item() == pytest.approx(-(1 + EPSILON_HIGH))


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_zero_advantages_give_zero_gradient(name: str) -> None:
    logprobs = (-torch.rand(16)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(16)
    log_ratio = importance_log_ratio(
        logprobs, old, torch.zeros(16, dtype=torch.long), level="token"
    )
    loss = policy_loss_function(name)(
        log_ratio, logprobs, torch.zeros(16), epsilon=EPSILON, epsilon_high=EPSILON_HIGH
    )
    token_mean(loss, 16).backward()
    assert logprobs.grad is not None
    assert torch.count_nonzero(logprobs.grad) == 0


def test_kl_penalty_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    logprobs = -torch.rand(32)
    assert torch.count_nonzero(kl_penalty(logprobs, logprobs)) == 0
    shifted = logprobs + torch.randn(32) * 0.5
    assert (kl_penalty(logprobs, shifted) > 0).all()
    # k3 against the reference definition exp(d) - d - 1, d = ref - logp
    delta = shifted - logprobs
    torch.testing.assert_close(kl_penalty(logprobs, shifted), torch.exp(delta) - delta - 1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
def test_chunked_logprobs_equal_the_full_log_softmax(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 16, generator=generator, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (10,), generator=generator)

    logprobs, entropy = token_logprobs(hidden, targets, head=head, chunk_size=chunk_size)
    logprobs.sum().backward()
    assert hidden.grad is not None and head.weight.grad is not None
    chunked_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    full = torch.log_softmax(head(hidden), dim=-1)  # (N, V), the naive way
    expected = full.gather(-1, targets[:, None])[:, 0]
    expected.sum().backward()
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach())
    torch.testing.assert_close(chunked_grads[0], hidden.grad)
    torch.testing.assert_close(chunked_grads[1], head.weight.grad)


def test_unknown_options_name_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="'ppo', 'cispo'"):
        policy_loss_function("grpo")
    with pytest.raises(ValueError, match="'token', 'sequence'"):
        importance_log_ratio(
            torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long), level="group"
        )
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(
            torch.zeros(2, 4),
            torch.zeros(2, dtype=torch.long),
            head=torch.nn.Identity(),
            chunk_size=0,
        )
