"""Tinker's training primitives: the loss functions against their formulas, gradient
accumulation over forward-backward calls, the Adam step, and weights loaded into a trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.protocol.tinker_api import AdamParams
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer import primitives as p

CONFIG = ModelConfig(lora_rank=4, lora_alpha=8)
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def _inputs(sampled: list[float], advantages: list[float]) -> p.Inputs:
    return {"logprobs": torch.tensor(sampled), "advantages": torch.tensor(advantages)}


def test_cross_entropy_is_the_weighted_negative_logprob() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -3.0])
    assert p.cross_entropy(logprobs, {}, {}).tolist() == [1.0, 2.0, 3.0]
    weighted = p.cross_entropy(logprobs, {"weights": torch.tensor([0.0, 1.0, 0.5])}, {})
    assert weighted.tolist() == [0.0, 2.0, 1.5]


def test_importance_sampling_weighs_advantages_by_the_ratio() -> None:
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = p.importance_sampling(logprobs, _inputs([-1.0, -1.0], [2.0, 3.0]), {})
    ratio = torch.exp(torch.tensor([0.0, -1.0]))
    assert loss.tolist() == pytest.approx((-ratio * torch.tensor([2.0, 3.0])).tolist())
    loss.sum().backward()
    # d/dlp of -exp(lp - q) * A is -ratio * A: raising a positive-advantage token's logprob
    # lowers the loss.
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == pytest.approx((-ratio * torch.tensor([2.0, 3.0])).tolist())


def test_ppo_takes_the_lesser_of_the_clipped_and_plain_objective() -> None:
    # Ratios 2 (above 1.2) and 0.5 (below 0.8), with positive and negative advantages.
    logprobs = torch.log(torch.tensor([2.0, 0.5, 2.0, 0.5]))
    inputs = _inputs([0.0] * 4, [1.0, 1.0, -1.0, -1.0])
    loss = p.ppo(logprobs, inputs, CLIP)
    # A > 0: min(2, 1.2) = 1.2 and min(0.5, 0.8) = 0.5; A < 0: min(-2, -1.2) = -2, min(-0.5, -0.8).
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 2.0, 0.8])


def test_cispo_weights_the_policy_gradient_by_the_clipped_ratio_without_differentiating_it() -> (
    None
):
    logprobs = torch.log(torch.tensor([2.0, 1.0])).requires_grad_(True)
    loss = p.cispo(logprobs, _inputs([0.0, 0.0], [1.0, 1.0]), CLIP)
    loss.sum().backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == pytest.approx([-1.2, -1.0])


def test_dro_penalizes_the_squared_log_ratio() -> None:
    logprobs = torch.tensor([-1.0, -2.0])
    loss = p.dro(logprobs, _inputs([-1.5, -2.0], [1.0, 0.0]), {"beta": 2.0})
    assert loss.tolist() == pytest.approx([1.0 + 0.25, 0.0])


@pytest.fixture
def trainer(tiny_model_path: Path) -> Trainer:
    return Trainer.load(str(tiny_model_path), model_config=CONFIG, device="cpu")


def _example(tokens: list[int]) -> p.Example:
    return p.Example(
        tokens=tokens[:-1],
        inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


FIRST, SECOND = _example([1, 5, 9, 13, 17]), _example([2, 4, 8, 16])


def _gradients(trainer: Trainer) -> list[torch.Tensor]:
    return [
        param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        for param in trainer.policy.trainable_parameters()
    ]


@pytest.mark.slow
def test_gradients_accumulate_over_forward_backward_calls(trainer: Trainer) -> None:
    # A trained adapter first: a fresh one has zero B matrices, hence zero A gradients.
    p.forward_backward(trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True)
    p.adam_step(trainer, AdamParams(learning_rate=1e-2))

    _, together = p.forward_backward(
        trainer.policy, [FIRST, SECOND], loss_fn="cross_entropy", config={}, backward=True
    )
    expected = _gradients(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    _, first = p.forward_backward(
        trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True
    )
    _, second = p.forward_backward(
        trainer.policy, [SECOND], loss_fn="cross_entropy", config={}, backward=True
    )
    assert first["loss:sum"] + second["loss:sum"] == pytest.approx(together["loss:sum"], rel=1e-6)
    assert p.has_gradients(trainer)
    # Two backward passes summed against one over both: fp32 sums in another order. With one
    # thread (the suite's) elements of about 1e-3 differed by 1.3e-6.
    accumulated_gradients = [g.clone() for g in _gradients(trainer)]
    for accumulated, single in zip(accumulated_gradients, expected, strict=True):
        assert torch.allclose(accumulated, single, rtol=1e-4, atol=1e-5)
    # A forward leaves the gradients alone.
    p.forward_backward(trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=False)
    for kept, accumulated in zip(_gradients(trainer), accumulated_gradients, strict=True):
        assert torch.equal(kept, accumulated)


def test_datums_sharing_a_forward_pass_are_computed_as_if_alone(trainer: Trainer) -> None:
    rows = p.pack_examples([FIRST, SECOND], row_tokens=64, packed=True)
    assert [indices for _, indices in rows] == [[0, 1]]  # one row, one forward pass
    together, _ = p.forward_backward(
        trainer.policy, [FIRST, SECOND], loss_fn="cross_entropy", config={}, backward=False
    )
    alone = [
        p.forward_backward(
            trainer.policy, [example], loss_fn="cross_entropy", config={}, backward=False
        )[0][0]
        for example in (FIRST, SECOND)
    ]
    for packed, single in zip(together, alone, strict=True):
        assert packed == pytest.approx(single, abs=1e-5)
    assert [
        len(indices) for _, indices in p.pack_examples([FIRST, SECOND], row_tokens=5, packed=True)
    ] == [1, 1]


def test_each_datum_in_a_shared_row_uses_its_own_inputs(trainer: Trainer) -> None:
    # One datum without weights (Tinker: weights of one), one with weights of its own; they
    # share a forward pass in either order, and each is weighed as if it were alone.
    plain = p.Example(tokens=[1, 5, 9, 13], inputs={"target_tokens": [5, 9, 13, 17]})
    weighted = p.Example(
        tokens=[2, 4, 8], inputs={"target_tokens": [4, 8, 16], "weights": [0.0, 2.0, 0.5]}
    )
    alone = [
        p.forward_backward(
            trainer.policy, [example], loss_fn="cross_entropy", config={}, backward=False
        )
        for example in (plain, weighted)
    ]
    (plain_logprobs,), _ = alone[0]
    (weighted_logprobs,), _ = alone[1]
    assert alone[0][1]["loss:sum"] == pytest.approx(-sum(plain_logprobs), rel=1e-5)
    expected_weighted = -sum(
        w * lp for w, lp in zip([0.0, 2.0, 0.5], weighted_logprobs, strict=True)
    )
    assert alone[1][1]["loss:sum"] == pytest.approx(expected_weighted, rel=1e-5)
    for order in ([plain, weighted], [weighted, plain]):
        assert len(p.pack_examples(order, row_tokens=64, packed=True)) == 1
        _, metrics = p.forward_backward(
            trainer.policy, order, loss_fn="cross_entropy", config={}, backward=False
        )
        assert metrics["loss:sum"] == pytest.approx(
            alone[0][1]["loss:sum"] + alone[1][1]["loss:sum"], rel=1e-5
        )


def test_the_adam_step_is_adamw_with_the_given_hyperparameters(trainer: Trainer) -> None:
    parameters = trainer.policy.trainable_parameters()
    copies = [param.detach().clone().requires_grad_(True) for param in parameters]
    reference = torch.optim.AdamW(copies, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    p.forward_backward(trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True)
    for copy, param in zip(copies, parameters, strict=True):
        copy.grad = None if param.grad is None else param.grad.clone()
    params = AdamParams(learning_rate=0.05, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    metrics = p.adam_step(trainer, params)
    reference.step()
    for copy, param in zip(copies, parameters, strict=True):
        assert torch.allclose(copy, param.detach(), atol=1e-7)
    assert metrics["learning_rate"] == 0.05 and metrics["grad_norm"] > 0
    assert not p.has_gradients(trainer) and trainer.step == 1


def test_a_non_finite_gradient_is_dropped_and_the_weights_kept(trainer: Trainer) -> None:
    p.forward_backward(trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True)
    parameters = trainer.policy.trainable_parameters()
    before = [param.detach().clone() for param in parameters]
    first = next(param for param in parameters if param.grad is not None)
    assert first.grad is not None
    first.grad[0] = float("nan")
    with pytest.raises(TrainingError, match="gradient norm is nan"):
        p.adam_step(trainer, AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    assert not p.has_gradients(trainer) and trainer.step == 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, parameters, strict=True))


def test_token_ids_outside_the_vocabulary_are_refused_before_any_gradient(trainer: Trainer) -> None:
    outside = p.Example(tokens=[1, 2], inputs={"target_tokens": [3, 10**9]})
    with pytest.raises(TrainingError, match="outside the model's vocabulary"):
        p.forward_backward(
            trainer.policy, [outside], loss_fn="cross_entropy", config={}, backward=True
        )
    assert not p.has_gradients(trainer)


@pytest.mark.slow
def test_saved_weights_load_back_exactly_with_or_without_the_optimizer(
    trainer: Trainer, tiny_model_path: Path, tmp_path: Path
) -> None:
    for _ in range(2):
        p.forward_backward(
            trainer.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True
        )
        p.adam_step(trainer, AdamParams(learning_rate=1e-2))
    trainer.save(tmp_path)
    expected, _ = p.forward_backward(
        trainer.policy, [SECOND], loss_fn="cross_entropy", config={}, backward=False
    )

    other = Trainer.load(str(tiny_model_path), model_config=CONFIG, device="cpu")
    p.load_weights(other, tmp_path, with_optimizer=True)
    found, _ = p.forward_backward(
        other.policy, [SECOND], loss_fn="cross_entropy", config={}, backward=False
    )
    assert found == expected and other.step == 2
    # The next steps match too: the Adam moments came along.
    for loaded in (trainer, other):
        p.forward_backward(
            loaded.policy, [FIRST], loss_fn="cross_entropy", config={}, backward=True
        )
        p.adam_step(loaded, AdamParams(learning_rate=1e-2))
    after = [
        p.forward_backward(t.policy, [SECOND], loss_fn="cross_entropy", config={}, backward=False)[
            0
        ]
        for t in (trainer, other)
    ]
    assert after[0] == after[1]

    fresh_optimizer = Trainer.load(str(tiny_model_path), model_config=CONFIG, device="cpu")
    p.load_weights(fresh_optimizer, tmp_path, with_optimizer=False)
    assert fresh_optimizer.optimizer.state_dict()["state"] == {}


def test_a_seed_decides_a_fresh_adapter(trainer: Trainer, tiny_model_path: Path) -> None:
    other = Trainer.load(str(tiny_model_path), model_config=CONFIG, device="cpu")
    p.reseed_adapter(trainer, 7)
    p.reseed_adapter(other, 7)
    first = [param.detach().clone() for param in trainer.policy.trainable_parameters()]
    assert all(
        torch.equal(a, b) for a, b in zip(first, other.policy.trainable_parameters(), strict=True)
    )
    p.reseed_adapter(other, 8)
    assert not all(
        torch.equal(a, b) for a, b in zip(first, other.policy.trainable_parameters(), strict=True)
    )
