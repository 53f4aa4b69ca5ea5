"""Packed rows with shared prompts compute what each sequence computes alone."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from skytrain_backend.protocol import TrajectoryGroup
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.packing import one_sequence_per_row, pack_sequences
from skytrain_backend.trainer.tokenize import TokenizedSequence, tokenize_rl_groups
from tests.fixtures.sampling import sample_choices


def _sequence(
    token_ids: list[int], first_trained: int, *, group: int = 0, history: int = 0
) -> TokenizedSequence:
    return TokenizedSequence(
        token_ids=token_ids,
        trained=[i >= first_trained for i in range(len(token_ids))],
        logprobs=[math.nan] * len(token_ids),
        group_index=group,
        history_index=history,
    )


def _sampled_groups(trainer: Trainer) -> list[TrajectoryGroup]:
    groups = []
    for g, question in enumerate(["Name a color.", "Count to three, please.", "Hi!"]):
        prompt = [{"role": "user", "content": question}]
        choices = sample_choices(
            trainer.policy.model, trainer.policy.tokenizer, prompt, n=3, max_new_tokens=10, seed=g
        )
        groups.append(
            TrajectoryGroup.model_validate(
                {
                    "trajectories": [
                        {"messages_and_choices": [*prompt, choice], "reward": float(r)}
                        for r, choice in enumerate(choices)
                    ]
                }
            )
        )
    return groups


@pytest.mark.slow
def test_packed_rows_give_the_same_logprobs_as_each_sequence_alone(tiny_trainer: Trainer) -> None:
    policy = tiny_trainer.policy
    # A trained-looking adapter: with B = 0 the LoRA path would not be exercised at all.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    batch = tokenize_rl_groups(
        policy.tokenizer,
        _sampled_groups(tiny_trainer),
        scale_rewards=True,
        allow_training_without_logprobs=False,
    )
    # Rows short enough that groups are split and several units share a row.
    row_length = max(len(s.token_ids) for s in batch.sequences) + 12
    packed = pack_sequences(batch.sequences, row_length=row_length)
    alone = one_sequence_per_row(batch.sequences, row_length=row_length)
    assert len(packed.rows) < len(alone.rows)
    assert any(not row.is_plain for row in packed.rows)
    assert packed.stats["packing/tokens_saved_by_prefix_sharing"] > 0

    policy.model.eval()
    with torch.no_grad():

        def by_site(rows: Any) -> dict[tuple[int, int], float]:
            values = {}
            for row in rows:
                logprobs, _ = policy.site_logprobs(row, chunk_size=5)
                for key, value in zip(
                    zip(row.sequence_indices, row.token_indices, strict=True),
                    logprobs.tolist(),
                    strict=True,
                ):
                    values[key] = value
            return values

        packed_values, alone_values = by_site(packed.rows), by_site(alone.rows)
        # The plain reference: the peft model's own forward and a full log-softmax.
        reference = {}
        for index, sequence in enumerate(alone.sequences):
            logits = policy.model(input_ids=torch.tensor([sequence.token_ids])).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for token in range(1, len(sequence.token_ids)):
                if sequence.trained[token]:
                    reference[(index, token)] = logprobs[
                        token - 1, sequence.token_ids[token]
                    ].item()

    assert packed_values.keys() == alone_values.keys() == reference.keys()
    keys = sorted(reference)
    torch.testing.assert_close(
        torch.tensor([packed_values[k] for k in keys]), torch.tensor([reference[k] for k in keys])
    )
    torch.testing.assert_close(
        torch.tensor([alone_values[k] for k in keys]), torch.tensor([reference[k] for k in keys])
    )


def test_prefix_sharing_stores_each_group_prompt_once() -> None:
    prompt = list(range(100, 120))
    sequences = [
        _sequence([*prompt, 1, 2, 3], 20, group=0),
        _sequence([*prompt, 4, 5], 20, group=0),
        _sequence([*prompt, 4, 6, 7, 8], 20, group=0),
        _sequence([9, 9, 9, 1, 2], 3, group=1),
    ]
    packing = pack_sequences(sequences, row_length=64)
    (row,) = packing.rows
    # Group 0 stores its 20-token prompt once (the prefix common to all its sequences).
    assert len(row) == 20 + 3 + 2 + 4 + 5
    assert packing.stats["packing/tokens_saved_by_prefix_sharing"] == 2 * 20
    # every trained token is one site, predicted from the token before it
    assert row.num_sites == 3 + 2 + 4 + 2
    for source, target, index, token in zip(
        row.source_positions, row.target_ids, row.sequence_indices, row.token_indices, strict=True
    ):
        sequence = packing.sequences[index]
        assert sequence.token_ids[token] == target
        assert row.input_ids[source] == sequence.token_ids[token - 1]
        assert row.position_ids[source] == token - 1


def test_truncation_keeps_the_start_and_counts_what_it_dropped() -> None:
    sequences = [
        _sequence(list(range(30)), 10),  # 20 trained, 10 of them beyond 20 tokens
        _sequence(list(range(30)), 25),  # every trained token beyond 20: dropped
        _sequence(list(range(12)), 6, group=1),
    ]
    packing = pack_sequences(sequences, row_length=20)
    assert packing.stats["tokens/truncated"] == 10 + 5
    assert packing.stats["sequences/dropped_by_truncation"] == 1
    assert [s.token_ids for s in packing.sequences] == [list(range(20)), list(range(12))]
    assert all(len(row) <= 20 for row in packing.rows)
    assert sum(row.num_sites for row in packing.rows) == 10 + 6


def test_a_group_too_long_for_one_row_is_split_with_its_prompt_repeated() -> None:
    prompt = list(range(100, 110))
    sequences = [_sequence(prompt + [i] * 6, 10) for i in range(4)]
    packing = pack_sequences(sequences, row_length=24)  # prompt + two completions per row
    assert [len(row) for row in packing.rows] == [22, 22]
    for row in packing.rows:
        assert row.input_ids[:10] == prompt
        assert len(set(row.sequence_indices)) == 2
    assert packing.stats["packing/tokens_saved_by_prefix_sharing"] == 2 * 10


def test_sequences_of_different_groups_never_see_each_other() -> None:
    sequences = [
        _sequence([1, 2, 3, 4], 2, group=0),
        _sequence([1, 2, 3, 5], 2, group=1),
    ]
    packing = pack_sequences(sequences, row_length=16)
    (row,) = packing.rows
    assert row.input_ids == [1, 2, 3, 4, 1, 2, 3, 5]  # no sharing across groups
    assert row.segment_ids[:4] != row.segment_ids[4:]
    assert row.parent_ids == row.segment_ids
    assert row.position_ids == [0, 1, 2, 3, 0, 1, 2, 3]
