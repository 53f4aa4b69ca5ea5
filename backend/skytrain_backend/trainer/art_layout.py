"""ART's rows: which sequences each of an ART job's optimizer steps trains, as openpipe-art
0.5.23 lays them out (``art/preprocessing/pack.py``), so a job sent through the ART protocol
takes ART's steps, each on ART's tokens, at ART's learning rate.

ART lays every sequence of a batch on one prefix tree: a run of tokens that several sequences
share from the same position (a system prompt common to every group, then each group's own
prompt) is one segment, kept only when it is at least ``ART_MIN_SHARED_PREFIX`` tokens long;
a sequence shares nothing from its first trained token on. A row holds the segments of its
sequences once each, so a sequence costs a row only the segments the row does not hold yet.

- Sequences longer than the row are dropped whole (ART's ``LocalBackend`` does, with a
  warning), never cut: ``ArtLayout.dropped``.
- Placement: the groups by their longest sequence, longest first; a group's sequences in ART's
  order (shuffled with the group's index as seed); each sequence into the row it leaves the
  least room in, a new row when none has room; then the rows shuffled with their number as
  seed.
- ``num_trajectories_learning_rate_multiplier_power``: ART scales a row's learning rate by
  (its tree's segment ids - its parent ids) ** power, the sequences that continue a shared
  segment: 0 in a row that shares nothing (``ArtLayout.trajectories``).
- ART's warm-up: a fresh trainer first steps once at learning rate 1e-9 on its first row cut
  to ``ART_WARMUP_TOKENS`` positions of its layout, the row's segments one after another
  (``ArtLayout.warmup``: how many tokens of each sequence that keeps).

Pure Python: no torch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from skytrain_backend.trainer.tokenize import TokenizedSequence

# ART shares a run of tokens in a row only when it is at least this long.
ART_MIN_SHARED_PREFIX = 64
# ART's warm-up step reads this many positions of its first row.
ART_WARMUP_TOKENS = 1024


@dataclass(frozen=True)
class _Segment:
    """A run of tokens of the tree: the sequences holding it, its length, the segment it
    continues (None at a root)."""

    members: tuple[int, ...]
    length: int
    parent: int | None


@dataclass(frozen=True)
class ArtLayout:
    """``rows``: indices into the sequences, one list per ART row (step) in ART's order;
    ``trajectories``: each row's count for the learning-rate multiplier; ``dropped``: the
    indices of the sequences longer than the row; ``warmup``: the first row cut for ART's
    warm-up step, (sequence index, tokens kept) of each sequence it keeps, and its count."""

    rows: list[list[int]]
    trajectories: list[int]
    dropped: list[int]
    warmup: tuple[list[tuple[int, int]], int] = ([], 0)


def prefix_tree(
    token_lists: Sequence[Sequence[int]],
    shareable: Sequence[int],
    *,
    min_shared: int = ART_MIN_SHARED_PREFIX,
) -> list[_Segment]:
    """The segments of ART's tree over ``token_lists``: the runs shared from one position by
    several sequences, each within the first ``shareable[i]`` tokens of every member and at
    least ``min_shared`` long, and the unshared rest of each sequence."""
    limits = [min(limit, len(tokens)) for limit, tokens in zip(shareable, token_lists, strict=True)]
    segments: list[_Segment] = []

    def add(members: Sequence[int], start: int, end: int, parent: int | None) -> int:
        segments.append(_Segment(tuple(members), end - start, parent))
        return len(segments) - 1

    def rest(index: int, start: int, parent: int | None) -> None:
        add((index,), start, len(token_lists[index]), parent)

    def split(members: Sequence[int], position: int) -> list[list[int]]:
        """``members`` by their token at ``position``, in order of first appearance."""
        parts: dict[int, list[int]] = {}
        for index in members:
            parts.setdefault(token_lists[index][position], []).append(index)
        return list(parts.values())

    def common_end(members: Sequence[int], start: int) -> int:
        # The lexicographically first and last sequences differ where any two first do.
        low = min(list(token_lists[index]) for index in members)
        high = max(list(token_lists[index]) for index in members)
        end, limit = start, min(limits[index] for index in members)
        while end < limit and low[end] == high[end]:
            end += 1
        return end

    def walk(members: Sequence[int], start: int, parent: int | None) -> None:
        active = [index for index in members if len(token_lists[index]) > start]
        together = [index for index in active if limits[index] > start]
        for index in active:
            if limits[index] <= start:
                rest(index, start, parent)
        if len(together) <= 1:
            for index in together:
                rest(index, start, parent)
            return
        end = common_end(together, start)
        if end == start:
            for part in split(together, start):
                walk(part, start, parent)
        elif end - start >= min_shared:
            walk(together, end, add(together, start, end, parent))
        else:
            # Too short to share: the sequences that can share beyond it are tried again
            # from ``start`` in smaller sets, split by their token at ``end``.
            beyond = [index for index in together if limits[index] > end]
            for index in together:
                if limits[index] <= end:
                    rest(index, start, parent)
            for part in split(beyond, end):
                walk(part, start, parent)

    walk(range(len(token_lists)), 0, None)
    return segments


def cut(
    members: Sequence[int], tree: Sequence[_Segment], length: int
) -> tuple[list[tuple[int, int]], int]:
    """The row laid out as ART lays it (``tree``'s segments one after another) cut to its
    first ``length`` positions: (sequence index, tokens kept) of each sequence with a token
    left, and the cut row's count for the learning-rate multiplier."""
    kept: dict[int, int] = {}
    segments: list[_Segment] = []
    position = 0
    for segment in tree:
        if position >= length:
            break
        tokens = min(segment.length, length - position)
        segments.append(segment)
        for member in segment.members:
            kept[members[member]] = kept.get(members[member], 0) + tokens
        position += segment.length
    return list(kept.items()), trajectory_count(segments)


def _common_prefix_length(token_lists: Sequence[Sequence[int]]) -> int:
    length = min(len(tokens) for tokens in token_lists)
    first = token_lists[0]
    for position in range(length):
        if any(tokens[position] != first[position] for tokens in token_lists[1:]):
            return position
    return length


def _first_trained(sequence: TokenizedSequence) -> int:
    return sequence.trained.index(True) if any(sequence.trained) else len(sequence.trained)


def shareable_lengths(sequences: Sequence[TokenizedSequence]) -> list[int]:
    """How much of each sequence ART may share: its group's common prefix, ending before the
    token that predicts the group's first trained token, and before its own."""
    by_group: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        by_group.setdefault(sequence.group_index, []).append(index)
    prompt: dict[int, int] = {}
    for group, indices in by_group.items():
        members = [sequences[index] for index in indices]
        common = _common_prefix_length([sequence.token_ids for sequence in members])
        first = min(_first_trained(sequence) for sequence in members)
        prompt[group] = max(min(common, first) - 1, 0)
    return [
        min(prompt[sequence.group_index], max(_first_trained(sequence) - 1, 0))
        for sequence in sequences
    ]


def trajectory_count(segments: Sequence[_Segment]) -> int:
    """ART's count for the learning-rate multiplier: the segments minus the distinct parents
    (a root is its own parent), that is the segments that continue another and end a branch."""
    parents = {
        index if segment.parent is None else segment.parent
        for index, segment in enumerate(segments)
    }
    return len(segments) - len(parents)


class _Row:
    def __init__(self) -> None:
        self.members: list[int] = []
        self.segments: set[int] = set()
        self.tokens = 0

    def cost(self, path: Sequence[tuple[int, int]]) -> int:
        return sum(length for segment, length in path if segment not in self.segments)

    def add(self, index: int, path: Sequence[tuple[int, int]]) -> None:
        self.tokens += self.cost(path)
        self.segments.update(segment for segment, _ in path)
        self.members.append(index)


def art_layout(sequences: Sequence[TokenizedSequence], *, row_length: int) -> ArtLayout:
    """ART's rows over ``sequences`` (a job's tokenized batch, in tokenization order)."""
    order: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        order.setdefault(sequence.group_index, []).append(index)
    for group, indices in order.items():
        random.Random(group).shuffle(indices)
    items = [index for indices in order.values() for index in indices]
    # A group's shared prompt is measured on all of its sequences, the dropped ones too.
    shareable = shareable_lengths(sequences)
    dropped = sorted(i for i in items if len(sequences[i].token_ids) > row_length)
    kept = [i for i in items if len(sequences[i].token_ids) <= row_length]
    if not kept:
        return ArtLayout(rows=[], trajectories=[], dropped=dropped)

    tree = prefix_tree([sequences[i].token_ids for i in kept], [shareable[i] for i in kept])
    paths: list[list[tuple[int, int]]] = [[] for _ in kept]
    for segment_id, segment in enumerate(tree):
        for member in segment.members:
            paths[member].append((segment_id, segment.length))
    by_group: dict[int, list[int]] = {}
    for position, index in enumerate(kept):
        by_group.setdefault(sequences[index].group_index, []).append(position)
    groups = sorted(
        by_group.values(),
        key=lambda positions: max(len(sequences[kept[p]].token_ids) for p in positions),
        reverse=True,
    )
    rows: list[_Row] = []
    for position in (p for positions in groups for p in positions):
        best, room = None, row_length + 1
        for row in rows:
            left = row_length - row.tokens - row.cost(paths[position])
            if 0 <= left < room:
                best, room = row, left
        if best is None:
            best = _Row()
            rows.append(best)
        best.add(position, paths[position])
    random.Random(len(rows)).shuffle(rows)

    members = [[kept[p] for p in row.members] for row in rows]
    trees = [
        prefix_tree([sequences[i].token_ids for i in row], [shareable[i] for i in row])
        for row in members
    ]
    return ArtLayout(
        rows=members,
        trajectories=[trajectory_count(tree) for tree in trees],
        dropped=dropped,
        warmup=cut(members[0], trees[0], ART_WARMUP_TOKENS),
    )
