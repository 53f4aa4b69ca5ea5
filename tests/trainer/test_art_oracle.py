"""An ART job trains exactly as ART does: openpipe-art 0.5.23's own code is the oracle.

For one batch (multi-turn tool calls, a trajectory at its group's mean reward, a group of
equal rewards, a group of rewards near 1e6 half a point apart), ART's ``ServerlessBackend.train``
says what it sends (each option set below), ART's tokenization and packing lay out the rows,
and ``art.loss.loss_fn`` gives the loss and its gradient with respect to the logprobs of a row;
the chain rule through the same model (fp64, its adapter moved off zero so the policy differs
from the reference) gives ART's gradient of the adapter. skytrain's job, made from the body
ART sends, must take as many optimizer steps as ART has rows, use ART's optimizer settings,
and compute the same loss and gradient.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.loss import token_logprobs
from skytrain_backend.trainer.packing import PackedRow
from skytrain_backend.trainer.plans import RLPlan
from skytrain_backend.trainer.tokenize import end_of_turn_token_id
from tests.fixtures.art import ART_EVERY_OPTION, art_train_request
from tests.fixtures.art_oracle import ArtOracle, ArtPacked
from tests.fixtures.sampling import choice_from_token_ids, sample_choices

MAX_SEQ_LENGTH = 4096
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Long enough for ART to share it between a group's rows (ART shares 64 tokens or more).
SYSTEM = {
    "role": "system",
    "content": "You are a careful weather assistant. Call get_weather for any city the user "
    "names, then answer in one short sentence with the temperature and the sky. Never guess "
    "a forecast, never answer for a city that was not asked about, and keep every answer "
    "under twenty words.",
}
CITIES = ["Paris", "Oslo", "Lima", "Cairo"]


def _with_ids(choice: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """The choice as skytrain's endpoints return it: every field of OpenAI's token logprobs,
    the prompt's ids and the sampled ids."""
    content = choice["logprobs"]["content"]
    for entry in content:
        entry.setdefault("bytes", None)
        entry.setdefault("top_logprobs", [])
    sampled = [int(entry["token"].removeprefix("token_id:")) for entry in content]
    return {**choice, "prompt_token_ids": prompt_ids, "token_ids": sampled}


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _off_policy(choice: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The sampler's logprobs moved (ratios from about 0.5 to 2), so every option acts."""
    for entry in choice["logprobs"]["content"]:
        entry["logprob"] += rng.uniform(-0.7, 0.7)
    return choice


def _agent_trajectory(model: Any, tokenizer: Any, city: str, seed: int) -> list[dict[str, Any]]:
    """system, user, a tool call, the tool's answer, a sampled reply."""
    rng = random.Random(seed)
    user = {"role": "user", "content": f"What is the weather in {city}?"}
    arguments = json.dumps({"city": city})
    call_text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    call_ids = [
        *tokenizer(call_text, add_special_tokens=False)["input_ids"],
        end_of_turn_token_id(tokenizer),
    ]
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{seed}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    context = [SYSTEM, user]
    call = choice_from_token_ids(
        model, tokenizer, context, call_ids, tools=TOOLS, message=call_message
    )
    call = _with_ids(_off_policy(call, rng), _prompt_ids(tokenizer, context, TOOLS))
    result = {"role": "tool", "tool_call_id": f"call_{seed}", "content": "18C, sunny"}
    context = [SYSTEM, user, call_message, result]
    (reply,) = sample_choices(
        model, tokenizer, context, n=1, max_new_tokens=10, seed=seed, tools=TOOLS
    )
    reply = _with_ids(_off_policy(reply, rng), _prompt_ids(tokenizer, context, TOOLS))
    return [SYSTEM, user, call, result, reply]


def _chat_group(
    model: Any, tokenizer: Any, question: str, rewards: list[float], seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    context = [SYSTEM, {"role": "user", "content": question}]
    prompt_ids = _prompt_ids(tokenizer, context, None)
    choices = sample_choices(
        model, tokenizer, context, n=len(rewards), max_new_tokens=10, seed=seed
    )
    return {
        "trajectories": [
            {
                "messages_and_choices": [*context, _with_ids(_off_policy(c, rng), prompt_ids)],
                "reward": reward,
            }
            for c, reward in zip(choices, rewards, strict=True)
        ]
    }


@pytest.fixture(scope="module")
def batch(tiny_hf_model: Any, tiny_tokenizer: Any) -> list[dict[str, Any]]:
    """Four groups as ART's client sends them (``TrajectoryGroup.model_dump(mode="json")``)."""
    agent = {
        "trajectories": [
            {
                "messages_and_choices": _agent_trajectory(
                    tiny_hf_model, tiny_tokenizer, city, seed
                ),
                "tools": TOOLS,
                "reward": reward,
            }
            for seed, (city, reward) in enumerate(zip(CITIES, [1.0, 0.0, 0.5, 0.2], strict=True))
        ]
    }
    return [
        agent,
        # 0.5 is the group's mean: that trajectory's advantage is exactly 0 (ART leaves it out).
        _chat_group(tiny_hf_model, tiny_tokenizer, "Name a colour.", [0.0, 1.0, 0.5, 0.5], 10),
        _chat_group(tiny_hf_model, tiny_tokenizer, "Say hello.", [1.0, 1.0], 11),
        # Half a point apart at 1e6: ART trains it (its rule is absolute).
        _chat_group(tiny_hf_model, tiny_tokenizer, "Count to two.", [1e6, 1e6 + 0.5], 12),
    ]


@pytest.fixture(scope="module")
def moved_trainer(tiny_model_path: Path) -> Trainer:
    """The tiny model in fp64 with its adapter moved off zero; tests train copies of it."""
    trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    trainer.policy.model.double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trainer


def _row_logprobs(
    trainer: Trainer, packed: ArtPacked, row: int, cut: int | None = None
) -> tuple[torch.Tensor, int]:
    """The policy's logprob of each position's next token in ART's row ``(1, S)`` (0 at the
    last real position and in the padding), and the row's real length; its first ``cut``
    positions only when given. ART's attention: a token sees its own segment and its
    parent's (``group_ids``, ``parent_ids``)."""
    tensors = {key: value[row][:cut] for key, value in packed.tensors.items()}
    length = int((tensors["group_ids"] != -1).sum())
    tokens = tensors["tokens"][:length].tolist()
    hidden = trainer.policy.hidden_states(
        PackedRow(
            input_ids=tokens,
            position_ids=tensors["input_pos"][:length].tolist(),
            segment_ids=tensors["group_ids"][:length].tolist(),
            parent_ids=tensors["parent_ids"][:length].tolist(),
        )
    )
    logprobs, _ = token_logprobs(
        hidden[:-1],
        torch.tensor(tokens[1:]),
        head=trainer.policy._head,
        chunk_size=4096,
    )
    padding = logprobs.new_zeros(tensors["tokens"].shape[0] - length + 1)
    return torch.cat([logprobs, padding])[None], length


def _arts_gradient(
    trainer: Trainer,
    oracle: ArtOracle,
    packed: ArtPacked,
    row: int = 0,
    cut: int | None = None,
    old: torch.Tensor | None = None,
) -> tuple[float, list[torch.Tensor]]:
    """ART's loss of ``row`` (its first ``cut`` positions) and its gradient of the adapter's
    parameters, at the trainer's parameters now; ``old``: the row's logprobs before the job
    (``_row_logprobs``), which ``precalculate_logprobs`` takes as old (default: now's)."""
    new_logprobs, _ = _row_logprobs(trainer, packed, row, cut)
    reference = None
    if packed.dev_config.get("kl_penalty_coef", 0.0) > 0 and cut is None:
        with torch.no_grad(), trainer.policy.adapter_disabled():
            reference, _ = _row_logprobs(trainer, packed, row)
    loss, grad = oracle.loss(row, new_logprobs, reference, cut, old)
    parameters = trainer.policy.trainable_parameters()
    gradients = torch.autograd.grad((new_logprobs * grad).sum(), parameters)
    return loss, list(gradients)


def _skytrains_step(
    trainer: Trainer, groups: list[dict[str, Any]], config: RLTrainConfig
) -> tuple[int, dict[str, float], dict[str, Any], list[torch.Tensor]]:
    """skytrain's job on the batch: its number of steps, the first step's metrics, optimizer
    settings and gradient (read where the optimizer takes it)."""
    seen: dict[str, Any] = {}
    step = trainer.optimizer_step

    def read_gradient(**settings: Any) -> float:
        seen["settings"] = settings
        seen["gradient"] = [
            parameter.grad.detach().clone() for parameter in trainer.policy.trainable_parameters()
        ]
        return step(**settings)

    trainer.optimizer_step = read_gradient  # type: ignore[method-assign]
    plan = trainer.prepare_rl([TrajectoryGroup.model_validate(g) for g in groups], config)
    metrics = next(iter(trainer.run(plan)))
    return plan.num_gradient_steps, metrics, seen["settings"], seen["gradient"]


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a, flat_b = torch.cat([x.flatten() for x in a]), torch.cat([x.flatten() for x in b])
    return float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))


def _norm(gradient: list[torch.Tensor]) -> float:
    return float(torch.cat([x.flatten() for x in gradient]).norm())


OPTION_SETS = {
    "defaults": {},
    "every option": ART_EVERY_OPTION,
    "kl from the sampler": {"kl_penalty_coef": 0.3},
    "sequence ratios, balance, unscaled": {
        "importance_sampling_level": "sequence",
        "advantage_balance": -0.5,
        "normalize_advantages": False,
    },
    "truncated importance sampling": {
        "precalculate_logprobs": True,
        "truncated_importance_sampling": 1.2,
    },
    "ppo masked, capped, kimi": {
        "loss_fn": "ppo",
        "mask_prob_ratio": True,
        "max_negative_advantage_importance_sampling_weight": 1.5,
        "kimi_k2_tau": 0.1,
        "importance_sampling_level": "average",
    },
}


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.slow
def test_an_art_job_makes_arts_update(
    art_oracle: ArtOracle,
    batch: list[dict[str, Any]],
    tiny_model_path: Path,
    moved_trainer: Trainer,
    options: dict[str, Any],
) -> None:
    packed = art_oracle.pack(
        batch, tokenizer=tiny_model_path, max_seq_length=MAX_SEQ_LENGTH, **options
    )
    # The request bodies the tests build (tests/fixtures/art.py) are ART's own.
    assert (
        packed.experimental_config
        == (art_train_request("oracle", [], **options)["experimental_config"])
    )
    config = RLTrainConfig.from_experimental(packed.experimental_config)
    trainer = copy.deepcopy(moved_trainer)
    assert packed.rows == 1
    arts_loss, arts_gradient = _arts_gradient(trainer, art_oracle, packed)

    steps, metrics, settings, gradient = _skytrains_step(trainer, batch, config)

    assert steps == packed.rows
    # ART's optimizer (art/dev/get_model_config.py, art/unsloth/train.py).
    assert (settings["adam_beta2"], settings["weight_decay"], settings["max_grad_norm"]) == (
        0.99,
        0.1,
        0.1,
    )
    assert metrics["loss/policy"] == pytest.approx(arts_loss, rel=1e-5, abs=1e-7)
    assert _cosine(gradient, arts_gradient) >= 0.9999
    assert _norm(gradient) == pytest.approx(_norm(arts_gradient), rel=1e-5)


def _agent_batch(
    groups: int,
    per_group: int,
    seed: int,
    *,
    system: int = 0,
    prompt: tuple[int, int] = (200, 350),
    turns: tuple[int, int] = (2, 5),
    sampled: tuple[int, int] = (40, 160),
    tool: tuple[int, int] = (20, 80),
) -> list[dict[str, Any]]:
    """Agent rollouts as token ids: a prompt per group (``system`` tokens common to every
    group, then the group's own), then ``turns`` of sampled ids, each after a tool's answer
    (lengths drawn from the ranges, upper bounds excluded)."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(count)]

    common = ids(system)
    batch = []
    for _ in range(groups):
        group_prompt = common + ids(rng.randrange(*prompt))
        trajectories = []
        for _ in range(per_group):
            context, items = list(group_prompt), []
            for _ in range(rng.randrange(*turns)):
                tokens = ids(rng.randrange(*sampled))
                items.append(
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "..."},
                        "logprobs": {
                            "content": [
                                {
                                    "token": f"token_id:{token}",
                                    "logprob": -1.0,
                                    "bytes": None,
                                    "top_logprobs": [],
                                }
                                for token in tokens
                            ]
                        },
                        "prompt_token_ids": list(context),
                        "token_ids": tokens,
                    }
                )
                context += tokens + ids(rng.randrange(*tool))  # the tool's answer
            trajectories.append(
                {
                    "messages_and_choices": [{"role": "user", "content": "..."}, *items],
                    "reward": rng.random(),
                }
            )
        batch.append({"trajectories": trajectories})
    return batch


def _sequence_length(trajectory: dict[str, Any]) -> int:
    last = trajectory["messages_and_choices"][-1]
    return len(last["prompt_token_ids"]) + len(last["token_ids"])


def _steps_as_art_does(
    art_oracle: ArtOracle,
    tiny_model_path: Path,
    trainer: Trainer,
    batch: list[dict[str, Any]],
    **options: Any,
) -> tuple[ArtPacked, RLPlan]:
    """ART's rows of ``batch`` and skytrain's plan of the job ART's client sends for it."""
    packed = art_oracle.pack(
        batch, tokenizer=tiny_model_path, max_seq_length=MAX_SEQ_LENGTH, **options
    )
    config = RLTrainConfig.from_experimental(packed.experimental_config)
    plan = trainer.prepare_rl([TrajectoryGroup.model_validate(g) for g in batch], config)
    assert plan.num_gradient_steps == packed.rows
    trained = [sum(row.num_sites for row in step.rows) for step in plan.steps]
    assert trained == packed.tensors["assistant_mask"].sum(dim=1).tolist()
    return packed, plan


@pytest.mark.slow
def test_an_art_job_takes_one_step_per_row_as_art_does(
    art_oracle: ArtOracle, tiny_model_path: Path, tiny_trainer: Trainer
) -> None:
    """ART's steps: one per packed row, rows of the longest sequence rounded up to 2048: many
    for an 8 x 4 batch of agent rollouts, each step training the tokens of ART's row, in
    ART's order; with a system prompt common to every group, ART shares it between groups
    in a row, so its rows hold other sequences than one prompt per group would."""
    packed, _ = _steps_as_art_does(
        art_oracle, tiny_model_path, tiny_trainer, _agent_batch(groups=8, per_group=4, seed=0)
    )
    assert packed.rows > 8
    shared = _agent_batch(groups=8, per_group=4, seed=1, system=120)
    _steps_as_art_does(art_oracle, tiny_model_path, tiny_trainer, shared)


@pytest.mark.slow
def test_an_art_job_drops_sequences_longer_than_its_rows_as_art_does(
    art_oracle: ArtOracle, tiny_model_path: Path, tiny_trainer: Trainer
) -> None:
    """A sequence longer than ``packed_sequence_length`` is left out whole, never cut and
    trained in part, and the job counts it."""
    batch = _agent_batch(
        groups=4,
        per_group=4,
        seed=2,
        prompt=(30, 50),
        turns=(1, 4),
        sampled=(10, 40),
        tool=(5, 15),
    )
    trajectories = [t for group in batch for t in group["trajectories"]]
    long = [t for t in trajectories if _sequence_length(t) > 128]
    assert 0 < len(long) < len(trajectories)
    _, plan = _steps_as_art_does(
        art_oracle, tiny_model_path, tiny_trainer, batch, packed_sequence_length=128
    )
    assert plan.summary["sequences/dropped"] == len(long)
    # The sampled tokens of the sequences left out (ART trains every sampled token).
    assert plan.summary["tokens/dropped"] == sum(
        len(item["token_ids"]) for t in long for item in t["messages_and_choices"][1:]
    )
    assert plan.summary["tokens/truncated"] == 0


@pytest.mark.slow
def test_an_art_jobs_learning_rate_per_step_is_arts(
    art_oracle: ArtOracle, tiny_model_path: Path, tiny_trainer: Trainer
) -> None:
    """``num_trajectories_learning_rate_multiplier_power``: ART scales each row's rate by the
    number of its tree's segments less the number of their parents, to the power
    (``art/unsloth/train.py``'s ``compute_loss``): rows of shared prompts train faster, and a
    row that shares nothing (prompts under 64 tokens) trains at rate 0."""
    power, learning_rate = 0.5, 1e-5
    shared = _agent_batch(groups=6, per_group=4, seed=3, system=70)
    unshared = _agent_batch(groups=2, per_group=2, seed=4, prompt=(10, 20))
    for batch, some_shared in ((shared, True), (unshared, False)):
        packed, plan = _steps_as_art_does(
            art_oracle,
            tiny_model_path,
            tiny_trainer,
            batch,
            learning_rate=learning_rate,
            num_trajectories_learning_rate_multiplier_power=power,
        )
        counts = [
            len(packed.tensors["group_ids"][row].unique())
            - len(packed.tensors["parent_ids"][row].unique())
            for row in range(packed.rows)
        ]
        assert (max(counts) > 1) == some_shared
        metrics = list(tiny_trainer.run(plan))
        assert [m["learning_rate"] for m in metrics] == pytest.approx(
            [learning_rate * count**power for count in counts], rel=1e-12, abs=0
        )


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.slow
def test_every_step_of_a_many_row_job_makes_arts_update(
    art_oracle: ArtOracle, tiny_model_path: Path, moved_trainer: Trainer, options: dict[str, Any]
) -> None:
    """A job of several rows, with each option set: at each step, once the earlier steps
    have moved the policy, skytrain's learning rate is ART's and its gradient has the
    direction and the norm of ART's loss at that point. Tokens without a sampler logprob
    keep ratio 1 on every step (ART takes the step's own logprobs for them, in the KL
    penalty's source too), not the ratio to the policy before the job."""
    batch = _agent_batch(
        groups=2,
        per_group=3,
        seed=5,
        prompt=(20, 40),
        turns=(1, 3),
        sampled=(10, 30),
        tool=(5, 10),
    )
    rng = random.Random(5)
    for group in batch:
        for trajectory in group["trajectories"]:
            for item in trajectory["messages_and_choices"][1:]:
                # Near the tiny model's logprobs of random tokens, so clipping and masks act
                # on some tokens only.
                for entry in item["logprobs"]["content"]:
                    entry["logprob"] = -10.8 + rng.uniform(-0.4, 0.4)
    for trajectory in batch[0]["trajectories"][:2]:  # sampled ids, no logprobs
        for item in trajectory["messages_and_choices"][1:]:
            item["logprobs"] = None
    options = {
        **options,
        "learning_rate": 1e-3,
        "allow_training_without_logprobs": True,
        "packed_sequence_length": 128,
    }
    packed = art_oracle.pack(
        batch, tokenizer=tiny_model_path, max_seq_length=MAX_SEQ_LENGTH, **options
    )
    assert packed.rows >= 2
    config = RLTrainConfig.from_experimental(packed.experimental_config)
    trainer = copy.deepcopy(moved_trainer)
    plan = trainer.prepare_rl([TrajectoryGroup.model_validate(g) for g in batch], config)
    assert plan.num_gradient_steps == packed.rows
    # ART's precalculate_logprobs reads every row's old logprobs once, before the first step.
    with torch.no_grad():
        precalculated = [_row_logprobs(trainer, packed, row)[0] for row in range(packed.rows)]
    arts: list[list[torch.Tensor]] = []
    ours: list[list[torch.Tensor]] = []
    step = trainer.optimizer_step
    warmup = plan.warmup is not None

    def compare(**settings: Any) -> float:
        nonlocal warmup
        if warmup:  # ART's warm-up (its own test is below)
            warmup = False
            return step(**settings)
        # Before this step's update: ART's gradient of its row at the same parameters.
        row = len(arts)
        arts.append(_arts_gradient(trainer, art_oracle, packed, row, old=precalculated[row])[1])
        ours.append([p.grad.detach().clone() for p in trainer.policy.trainable_parameters()])
        return step(**settings)

    trainer.optimizer_step = compare  # type: ignore[method-assign]
    metrics = list(trainer.run(plan))
    power = options.get("num_trajectories_learning_rate_multiplier_power", 0.0)
    counts = [
        len(packed.tensors["group_ids"][row].unique())
        - len(packed.tensors["parent_ids"][row].unique())
        for row in range(packed.rows)
    ]
    assert [m["learning_rate"] for m in metrics] == pytest.approx(
        [1e-3 * count**power for count in counts], rel=1e-12, abs=0
    )
    assert any(_norm(art) > 0 for art in arts)
    for index, (art, our) in enumerate(zip(arts, ours, strict=True)):
        assert _norm(our) == pytest.approx(_norm(art), rel=1e-5, abs=1e-12), f"step {index + 1}"
        if _norm(art) > 0:
            assert _cosine(our, art) >= 0.9999, f"step {index + 1}"


@pytest.mark.slow
def test_a_fresh_trainer_takes_arts_warm_up_step_first(
    art_oracle: ArtOracle, tiny_model_path: Path, moved_trainer: Trainer
) -> None:
    """A model's first ART job starts as ART's fresh trainer does: one optimizer step at
    learning rate 1e-9 on the first row cut to 1,024 positions (ART's loss on that cut at
    the same parameters: same direction and norm), then the job's steps, so AdamW has
    stepped once more than the job has rows."""
    batch = _agent_batch(groups=3, per_group=3, seed=6)
    packed = art_oracle.pack(batch, tokenizer=tiny_model_path, max_seq_length=MAX_SEQ_LENGTH)
    assert int((packed.tensors["group_ids"][0] != -1).sum()) > 1024  # the warm-up cuts it
    config = RLTrainConfig.from_experimental(packed.experimental_config)
    trainer = copy.deepcopy(moved_trainer)
    assert not trainer.optimizer.state
    plan = trainer.prepare_rl([TrajectoryGroup.model_validate(g) for g in batch], config)
    calls: list[tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]] = []
    step = trainer.optimizer_step

    def record(**settings: Any) -> float:
        ours = [p.grad.detach().clone() for p in trainer.policy.trainable_parameters()]
        arts = _arts_gradient(trainer, art_oracle, packed, 0, cut=1024)[1] if not calls else []
        calls.append((settings, ours, arts))
        return step(**settings)

    trainer.optimizer_step = record  # type: ignore[method-assign]
    list(trainer.run(plan))
    assert [settings["learning_rate"] for settings, _, _ in calls] == [1e-9] + [5e-6] * packed.rows
    _, ours, arts = calls[0]
    assert _cosine(ours, arts) >= 0.9999
    assert _norm(ours) == pytest.approx(_norm(arts), rel=1e-5)
    (first, *_) = trainer.policy.trainable_parameters()
    assert int(trainer.optimizer.state[first]["step"]) == packed.rows + 1
