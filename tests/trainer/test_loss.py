"""The loss functions against direct, unoptimized reference implementations (values + grads).

The references follow ART's definitions token by token, written the plain way: the importance
ratio at ART's four levels (token, sequence, their average, their geometric average), then
ART's cap, mask and Kimi K2 correction in ART's order, then PPO or CISPO.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from skytrain_backend.trainer.loss import (
    capped_ratio,
    cispo_loss,
    clipped_fractions,
    importance_ratio,
    kimi_k2_advantages,
    kl_penalty,
    masked_ratio,
    policy_loss_function,
    ppo_loss,
    token_logprobs,
    token_mean,
)

EPSILON, EPSILON_HIGH = 0.2, 0.28
LEVELS = ["token", "sequence", "average", "geometric_average"]
OPTIONS: list[dict[str, Any]] = [
    {},
    {"cap": 0.9},
    {"mask": True},
    {"tau": 0.3},
    {"cap": 1.1, "mask": True, "tau": 0.3},
]


def _reference_loss(
    name: str,
    level: str,
    logprobs: list[torch.Tensor],
    old_logprobs: list[float],
    advantages: list[float],
    sequence_ids: list[int],
    *,
    cap: float | None = None,
    mask: bool = False,
    tau: float | None = None,
) -> torch.Tensor:
    """Token by token, as ART writes it."""
    total = torch.zeros((), dtype=torch.float64)
    for i, logprob in enumerate(logprobs):
        token_ratio = torch.exp(logprob - old_logprobs[i])
        members = [j for j, s in enumerate(sequence_ids) if s == sequence_ids[i]]
        mean_log_ratio = sum(logprobs[j] - old_logprobs[j] for j in members) / len(members)
        sequence_ratio = torch.exp(mean_log_ratio)
        ratio = {
            "token": token_ratio,
            "sequence": sequence_ratio,
            "average": (token_ratio + sequence_ratio) / 2,
            "geometric_average": token_ratio**0.5 * sequence_ratio**0.5,
        }[level]
        if cap is not None and ratio.item() > cap:
            ratio = torch.tensor(cap, dtype=torch.float64)
        if mask and not 1 - EPSILON < ratio.item() < 1 + EPSILON_HIGH:
            ratio = torch.tensor(0.0, dtype=torch.float64)
        advantage = advantages[i]
        if tau is not None:
            advantage -= tau * (logprob.item() - old_logprobs[i])
        if name == "ppo":
            clipped = torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON_HIGH)
            total = total - torch.min(ratio * advantage, clipped * advantage)
        else:
            weight = min(max(ratio.item(), 1 - EPSILON), 1 + EPSILON_HIGH)
            total = total - weight * advantage * logprob
    return total / len(logprobs)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o) or "plain")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_policy_loss_matches_art_reference_values_and_gradients(
    name: str, level: str, options: dict[str, Any]
) -> None:
    generator = torch.Generator().manual_seed(7)
    n = 40
    logprobs = (-torch.rand(n, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    sequence_ids = torch.randint(0, 5, (n,), generator=generator)
    # Old logprobs spread enough that many token and sequence ratios fall outside
    # [1 - eps, 1 + eps_high].
    shift = torch.randn(5, generator=generator, dtype=torch.float64) * 0.3
    noise = torch.randn(n, generator=generator, dtype=torch.float64) * 0.4
    old = logprobs.detach() + noise + shift[sequence_ids]
    advantages = torch.randn(n, generator=generator, dtype=torch.float64)

    ratio = importance_ratio(logprobs, old, sequence_ids, level=level)
    ratio = capped_ratio(ratio, options.get("cap"))
    if options.get("mask"):
        ratio = masked_ratio(ratio, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    shaped = advantages
    if "tau" in options:
        shaped = kimi_k2_advantages(advantages, logprobs, old, tau=options["tau"])
    loss = token_mean(
        policy_loss_function(name)(
            ratio, logprobs, shaped, epsilon=EPSILON, epsilon_high=EPSILON_HIGH
        ),
        n,
    )
    (gradient,) = torch.autograd.grad(loss, logprobs)

    reference_inputs = [logprobs.detach()[i].clone().requires_grad_() for i in range(n)]
    reference = _reference_loss(
        name,
        level,
        reference_inputs,
        old.tolist(),
        advantages.tolist(),
        sequence_ids.tolist(),
        cap=options.get("cap"),
        mask=bool(options.get("mask")),
        tau=options.get("tau"),
    )
    gradients = (
        torch.autograd.grad(reference, reference_inputs, allow_unused=True)
        if reference.requires_grad
        else [None] * n
    )
    reference_gradient = torch.stack(
        [torch.zeros((), dtype=torch.float64) if g is None else g for g in gradients]
    )

    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(gradient, reference_gradient)
    if options:  # every option changes the loss or its gradient on these off-policy tokens
        plain = token_mean(
            policy_loss_function(name)(
                importance_ratio(logprobs, old, sequence_ids, level=level),
                logprobs,
                advantages,
                epsilon=EPSILON,
                epsilon_high=EPSILON_HIGH,
            ),
            n,
        )
        (plain_gradient,) = torch.autograd.grad(plain, logprobs)
        assert not (torch.allclose(plain, loss) and torch.allclose(plain_gradient, gradient))


def test_levels_differ_from_each_other_off_policy_and_agree_on_policy() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    old = logprobs + torch.tensor([0.3, -0.1, 0.2, 0.0])
    sequence_ids = torch.tensor([0, 0, 1, 1])
    ratios = [importance_ratio(logprobs, old, sequence_ids, level=level) for level in LEVELS]
    for i in range(len(ratios)):
        for j in range(i + 1, len(ratios)):
            assert not torch.allclose(ratios[i], ratios[j])
    for level in LEVELS:
        assert torch.equal(
            importance_ratio(logprobs, logprobs, sequence_ids, level=level), torch.ones(4)
        )


def test_ppo_clipped_tokens_get_no_gradient_and_are_counted() -> None:
    logprobs = torch.zeros(4, requires_grad=True)
    # ratios: 2.0 (A > 0: above 1 + eps_high, clipped), 0.5 (A < 0: below 1 - eps, clipped),
    # 2.0 with A < 0 and 0.5 with A > 0 (the unclipped side of min: gradient flows).
    old = torch.log(torch.tensor([0.5, 2.0, 0.5, 2.0]))
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    ratio = importance_ratio(logprobs, old, torch.zeros(4, dtype=torch.long), level="token")
    loss = ppo_loss(ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    loss.sum().backward()

    assert logprobs.grad is not None
    assert logprobs.grad[:2].tolist() == [0.0, 0.0]
    assert logprobs.grad[2:].abs().min() > 0
    # the clipped tokens' loss is the clipped ratio times the advantage
    assert loss[0].item() == pytest.approx(-(1 + EPSILON_HIGH))
    assert loss[1].item() == pytest.approx(1 - EPSILON)
    low, high = clipped_fractions(ratio, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    assert low.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert high.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_cispo_keeps_a_bounded_gradient_where_ppo_clips() -> None:
    logprobs = torch.zeros(1, requires_grad=True)
    old = torch.log(torch.tensor([0.5]))  # ratio 2
    advantages = torch.tensor([1.0])
    ratio = importance_ratio(logprobs, old, torch.zeros(1, dtype=torch.long), level="token")
    cispo_loss(ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH).backward()
    assert logprobs.grad is not None
    assert logprobs.grad.item() == pytest.approx(-(1 + EPSILON_HIGH))


def test_the_cap_binds_under_ppo_only_for_negative_advantages() -> None:
    """ART's name for it: with a positive advantage PPO's min already clips the ratio."""
    logprobs = torch.zeros(2, requires_grad=True)
    old = torch.log(torch.tensor([0.25, 0.25]))  # ratio 4
    advantages = torch.tensor([1.0, -1.0])
    ratio = importance_ratio(logprobs, old, torch.zeros(2, dtype=torch.long), level="token")
    uncapped = ppo_loss(ratio, logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    capped = ppo_loss(
        capped_ratio(ratio, 2.0), logprobs, advantages, epsilon=EPSILON, epsilon_high=EPSILON_HIGH
    )
    assert capped[0].item() == uncapped[0].item() == pytest.approx(-(1 + EPSILON_HIGH))
    assert (uncapped[1].item(), capped[1].item()) == (pytest.approx(4.0), pytest.approx(2.0))


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_zero_advantages_give_zero_gradient(name: str) -> None:
    logprobs = (-torch.rand(16)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(16)
    ratio = importance_ratio(logprobs, old, torch.zeros(16, dtype=torch.long), level="token")
    loss = policy_loss_function(name)(
        ratio, logprobs, torch.zeros(16), epsilon=EPSILON, epsilon_high=EPSILON_HIGH
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
    with pytest.raises(ValueError, match="'token', 'sequence', 'average', 'geometric_average'"):
        importance_ratio(
            torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long), level="group"
        )
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(
            torch.zeros(2, 4),
            torch.zeros(2, dtype=torch.long),
            head=torch.nn.Identity(),
            chunk_size=0,
        )
