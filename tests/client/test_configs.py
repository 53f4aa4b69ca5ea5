"""The SDK's configs mirror the server's, and what they send is what the server accepts."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

import skytrain
from skytrain_backend import protocol

MIRRORS = [
    (skytrain.ModelConfig, protocol.ModelConfig),
    (skytrain.TrainConfig, protocol.RLTrainConfig),
    (skytrain.SFTConfig, protocol.SFTTrainConfig),
]


@pytest.mark.parametrize(("client", "server"), MIRRORS)
def test_client_config_has_exactly_the_servers_fields(
    client: type[BaseModel], server: type[BaseModel]
) -> None:
    assert set(client.model_fields) == set(server.model_fields)


def _bounds(model: type[BaseModel], name: str) -> set[tuple[str, object]]:
    metadata = model.model_fields[name].metadata
    return {
        (type(item).__name__, value)
        for item in metadata
        for value in [getattr(item, type(item).__name__.lower(), None)]
        if type(item).__name__ in ("Ge", "Gt", "Le", "Lt", "MinLen", "MaxLen")
    }


@pytest.mark.parametrize(("client", "server"), MIRRORS)
def test_client_config_refuses_what_the_server_refuses(
    client: type[BaseModel], server: type[BaseModel]
) -> None:
    """Same bounds on both sides: a bad value fails in the SDK, before any request."""
    for name in server.model_fields:
        assert _bounds(client, name) == _bounds(server, name), name


@pytest.mark.parametrize(("client", "server"), MIRRORS)
def test_unset_fields_are_not_sent_so_server_defaults_apply(
    client: type[BaseModel], server: type[BaseModel]
) -> None:
    assert client()._to_request() == {}  # type: ignore[attr-defined]
    assert server.model_validate({}) == server()


def test_every_set_field_is_accepted_by_the_server() -> None:
    sent = skytrain.TrainConfig(
        preset="art",
        learning_rate=1e-5,
        loss_fn="cispo",
        epsilon=0.1,
        epsilon_high=0.3,
        importance_sampling_level="geometric_average",
        advantage_balance=0.5,
        max_negative_advantage_importance_sampling_weight=2.0,
        mask_prob_ratio=True,
        kimi_k2_tau=0.01,
        precalculate_logprobs=True,
        truncated_importance_sampling=2.0,
        kl_penalty_coef=0.01,
        kl_penalty_source="current_learner",
        kl_penalty_step_lag=2,
        scale_rewards=False,
        max_off_policy_steps=2,
        allow_training_without_logprobs=True,
        unsampled_old_logprobs="job_start",
        warmup_step=True,
        aggregation="token_mean",
        logprob_calculation_chunk_size=256,
        packed_sequence_length=2048,
        num_gradient_steps=4,
        num_trajectories_learning_rate_multiplier_power=0.5,
        adam_beta2=0.95,
        max_grad_norm=0.5,
        weight_decay=0.1,
        seed=7,
    )._to_request()
    dumped = protocol.RLTrainConfig.model_validate(sent).model_dump()
    assert dumped.pop("kl_penalty_reference_step") is None  # at most one of it and the lag
    assert dumped == sent
    by_step = skytrain.TrainConfig(kl_penalty_reference_step=3)._to_request()
    assert protocol.RLTrainConfig.model_validate(by_step).kl_penalty_reference_step == 3
    per_row = skytrain.TrainConfig(num_gradient_steps="per_row")._to_request()
    assert protocol.RLTrainConfig.model_validate(per_row).num_gradient_steps == "per_row"
    model = skytrain.ModelConfig(
        lora_rank=16,
        lora_alpha=32,
        lora_dropout=0.05,
        lora_target_modules=["q_proj", "v_proj"],
        max_seq_length=1024,
        gradient_checkpointing=True,
        min_replicas=1,
        max_replicas=3,
    )._to_request()
    assert protocol.ModelConfig.model_validate(model).model_dump() == model
    sft = skytrain.SFTConfig(
        learning_rate=[1e-4, 5e-5],
        batch_size=4,
        assistant_turns="last",
        num_epochs=2,
        max_grad_norm=2.0,
        seed=1,
    )._to_request()
    assert protocol.SFTTrainConfig.model_validate(sft).model_dump() == sft


def test_unknown_or_invalid_options_fail_in_the_client() -> None:
    with pytest.raises(ValidationError, match="learning_rat"):
        skytrain.TrainConfig(learning_rat=1e-5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="'ppo' or 'cispo'"):
        skytrain.TrainConfig(loss_fn="dpo")
    with pytest.raises(ValidationError, match="lora_rank"):
        skytrain.ModelConfig(lora_rank=0)


def test_the_art_preset_fills_only_what_is_left_unset() -> None:
    """One option away from ART's settings; the options sent with it still win."""
    art = protocol.RLTrainConfig.model_validate(skytrain.TrainConfig(preset="art")._to_request())
    assert (art.loss_fn, art.aggregation, art.num_gradient_steps) == ("cispo", "art", "per_row")
    assert (art.adam_beta2, art.weight_decay, art.max_grad_norm) == (0.99, 0.1, 0.1)
    assert art.kl_penalty_source == "current_learner"
    mixed = protocol.RLTrainConfig.model_validate(
        skytrain.TrainConfig(
            preset="art", loss_fn="ppo", num_gradient_steps=2, kl_penalty_coef=0.1
        )._to_request()
    )
    assert (mixed.loss_fn, mixed.num_gradient_steps) == ("ppo", 2)
    assert (mixed.aggregation, mixed.kl_penalty_source) == ("art", "sample")
    # Without the preset, skytrain's documented defaults.
    plain = protocol.RLTrainConfig()
    assert (plain.loss_fn, plain.aggregation, plain.num_gradient_steps) == ("ppo", "token_mean", 1)
    assert (plain.adam_beta2, plain.weight_decay, plain.max_grad_norm) == (0.999, 0.0, 1.0)
    assert plain.kl_penalty_source is None
