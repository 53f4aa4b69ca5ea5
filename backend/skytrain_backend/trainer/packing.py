"""Packing tokenized sequences into rows of at most ``row_length`` tokens.

Rollouts of one group usually share a long prompt and differ only in their completions. A packed
row stores such a prompt once, followed by each completion; the attention mask lets every
completion see its own prompt and itself, nothing else, and its position ids continue from the
prompt's length, so each completion is computed exactly as if it were alone (a test proves it
against ``one_sequence_per_row``). Several groups fill a row until it is full (first-fit
decreasing).

Instead of shifting labels, a row lists *prediction sites*: the logprob of ``target_ids[i]`` is
read from the hidden state at ``source_positions[i]``. A shared prompt's last token predicts the
first token of every completion that follows it, so one position can serve several sites, and
only trained tokens ever reach the (vocabulary-sized) output layer.

Truncation rules: a sequence longer than ``row_length`` keeps its first ``row_length`` tokens;
trained tokens beyond are dropped and counted (``tokens/truncated``), and a sequence left with
no trained token is dropped and counted (``sequences/dropped_by_truncation``). A group whose
completions do not fit one row with their prompt is split over several rows, each repeating the
prompt.

Pure Python: no torch here; the forward pass turns a row into tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from skytrain_backend.trainer.tokenize import TokenizedSequence


@dataclass
class PackedRow:
    """One model input: tokens, positions, attention blocks, and where to read each logprob."""

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    # Token q may attend token k <= q iff segment_ids[k] is segment_ids[q] or parent_ids[q].
    segment_ids: list[int] = field(default_factory=list)
    parent_ids: list[int] = field(default_factory=list)
    source_positions: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    sequence_indices: list[int] = field(default_factory=list)
    token_indices: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def is_plain(self) -> bool:
        """A single sequence from position 0: an ordinary causal forward, no custom mask."""
        return len(set(self.segment_ids)) <= 1

    @property
    def num_sites(self) -> int:
        return len(self.target_ids)


@dataclass
class Packing:
    """Rows over ``sequences`` (the truncated, kept ones that rows index into) and statistics."""

    rows: list[PackedRow]
    sequences: list[TokenizedSequence]
    stats: dict[str, float]


def _learnable(sequence: TokenizedSequence) -> bool:
    # The first token has nothing before it to be predicted from.
    return any(sequence.trained[1:])


def _truncate(
    sequences: Sequence[TokenizedSequence], row_length: int
) -> tuple[list[TokenizedSequence], dict[str, float]]:
    kept = []
    truncated_tokens = truncated = dropped = 0
    for sequence in sequences:
        if len(sequence.token_ids) > row_length:
            shorter = sequence.truncated(row_length)
            truncated_tokens += sequence.num_trained - shorter.num_trained
            truncated += 1
            sequence = shorter
        if _learnable(sequence):
            kept.append(sequence)
        else:
            dropped += 1
    return kept, {
        "tokens/truncated": float(truncated_tokens),
        "sequences/truncated": float(truncated),
        "sequences/dropped_by_truncation": float(dropped),
    }


def _common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    length = min(len(sequence) for sequence in sequences)
    for position in range(length):
        token = first[position]
        if any(sequence[position] != token for sequence in sequences[1:]):
            return position
    return length


@dataclass
class _Unit:
    """A shared prefix and the sequences continuing it: always placed in one row together."""

    prefix_length: int
    sequence_indices: list[int]
    length: int


def _units(kept: Sequence[TokenizedSequence], row_length: int, share_prefixes: bool) -> list[_Unit]:
    partitions: dict[tuple[int, int] | int, list[int]] = {}
    for index, sequence in enumerate(kept):
        key = (sequence.group_index, sequence.history_index) if share_prefixes else index
        partitions.setdefault(key, []).append(index)
    units = []
    for indices in partitions.values():
        prefix = 0
        if len(indices) > 1:
            token_lists = [kept[i].token_ids for i in indices]
            # Each sequence keeps at least one token of its own after the shared prefix.
            prefix = min(
                _common_prefix_length(token_lists), min(len(ids) for ids in token_lists) - 1
            )
        current = _Unit(prefix, [], prefix)
        for index in indices:
            extra = len(kept[index].token_ids) - prefix
            if current.sequence_indices and current.length + extra > row_length:
                units.append(current)
                current = _Unit(prefix, [], prefix)
            current.sequence_indices.append(index)
            current.length += extra
        units.append(current)
    return units


def _assemble(kept: Sequence[TokenizedSequence], units: Sequence[_Unit]) -> PackedRow:
    row = PackedRow()
    segment = 0

    def append(token_ids: Sequence[int], first_position: int, own: int, parent: int) -> None:
        row.input_ids += token_ids
        row.position_ids += range(first_position, first_position + len(token_ids))
        row.segment_ids += [own] * len(token_ids)
        row.parent_ids += [parent] * len(token_ids)

    for unit in units:
        prefix = unit.prefix_length
        prefix_start = len(row)
        prefix_segment = segment
        if prefix:
            first = kept[unit.sequence_indices[0]].token_ids
            append(first[:prefix], 0, prefix_segment, prefix_segment)
            segment += 1
        for index in unit.sequence_indices:
            sequence = kept[index]
            start = len(row)
            append(
                sequence.token_ids[prefix:],
                prefix,
                segment,
                prefix_segment if prefix else segment,
            )
            segment += 1
            for token in range(1, len(sequence.token_ids)):
                if not sequence.trained[token]:
                    continue
                source = token - 1
                row.source_positions.append(
                    prefix_start + source if source < prefix else start + source - prefix
                )
                row.target_ids.append(sequence.token_ids[token])
                row.sequence_indices.append(index)
                row.token_indices.append(token)
    return row


def _stats(
    rows: Sequence[PackedRow], kept: Sequence[TokenizedSequence], row_length: int
) -> dict[str, float]:
    real = sum(len(row) for row in rows)
    unshared = sum(len(sequence.token_ids) for sequence in kept)
    capacity = len(rows) * row_length
    return {
        "sequences/trained": float(len(kept)),
        "tokens/trainable": float(sum(row.num_sites for row in rows)),
        "packing/rows": float(len(rows)),
        "packing/row_length": float(row_length),
        "packing/real_tokens": float(real),
        "packing/capacity_tokens": float(capacity),
        "packing/efficiency": real / capacity if capacity else 0.0,
        "packing/tokens_saved_by_prefix_sharing": float(unshared - real),
    }


def pack_sequences(
    sequences: Sequence[TokenizedSequence], *, row_length: int, share_prefixes: bool = True
) -> Packing:
    """Pack into as few rows as first-fit decreasing finds, sharing each group's prompt."""
    kept, stats = _truncate(sequences, row_length)
    units = sorted(_units(kept, row_length, share_prefixes), key=lambda u: -u.length)
    bins: list[list[_Unit]] = []
    free: list[int] = []
    for unit in units:
        for position, space in enumerate(free):
            if unit.length <= space:
                bins[position].append(unit)
                free[position] -= unit.length
                break
        else:
            bins.append([unit])
            free.append(row_length - unit.length)
    rows = [_assemble(kept, units_in_row) for units_in_row in bins]
    return Packing(rows=rows, sequences=kept, stats=stats | _stats(rows, kept, row_length))


def one_sequence_per_row(sequences: Sequence[TokenizedSequence], *, row_length: int) -> Packing:
    """The simple path: each sequence alone in its row, an ordinary causal forward.

    Used where a custom attention mask is not available (Unsloth's patched attention) and as
    the reference the packed rows are tested against.
    """
    kept, stats = _truncate(sequences, row_length)
    rows = [
        _assemble(kept, [_Unit(0, [index], len(sequence.token_ids))])
        for index, sequence in enumerate(kept)
    ]
    return Packing(rows=rows, sequences=kept, stats=stats | _stats(rows, kept, row_length))


def merged_stats(packings: Sequence[Packing], *, row_length: int) -> dict[str, float]:
    """The statistics of several packings (one per optimizer step) as one job's."""
    totals: dict[str, float] = {}
    for packing in packings:
        for key, value in packing.stats.items():
            totals[key] = totals.get(key, 0.0) + value
    capacity = totals.get("packing/capacity_tokens", 0.0)
    return totals | {
        "packing/row_length": float(row_length),
        "packing/efficiency": totals.get("packing/real_tokens", 0.0) / capacity
        if capacity
        else 0.0,
    }
