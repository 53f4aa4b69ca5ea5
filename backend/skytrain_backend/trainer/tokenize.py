"""Trajectories to the exact token ids the policy produced.

The trainer must learn from the tokens the engine sampled, not from a re-tokenization of their
text: "Hello" sampled as ``Hel`` + ``lo`` is a different event, with a different logprob, than
the single token ``Hello``. So each conversation is rendered with the base model's chat template
(tools included) where every trained assistant turn is replaced by a unique marker; the text
between markers is tokenized as the engine tokenized its prompt, and each marker is replaced by
the turn's sampled token ids (vLLM's ``token_id:<id>`` convention) with their sampling logprobs.

After a sampled turn the template writes its closing tokens (``<|im_end|>\\n`` for ChatML). When
the sampled ids already end with some of them (a turn that stopped on its end-of-turn token),
only the rest is appended, so the trained sequence is exactly: template prefix + sampled ids +
whatever closing tokens the model did not sample. Closing tokens the model did not sample are
context, never trained.

Assistant turns given as plain messages (no token ids) are context unless the caller trains on
them (``allow_training_without_logprobs`` in RL, every SFT turn): their text is tokenized up to
the template's end-of-turn token, which is trained too (that is how the model learns to stop),
and their logprobs are unknown (NaN; the loss uses the current policy's instead).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import Choice, History, Message, Trajectory, TrajectoryGroup
from skytrain_backend.trainer.advantages import group_advantages

AssistantTurns = Literal["all", "last"]


@dataclass
class TokenizedSequence:
    """One conversation as token ids, with which of them are trained and their sampling logprobs.

    ``logprobs[i]`` is the engine's logprob of ``token_ids[i]`` where it sampled that token, NaN
    elsewhere. ``history_index`` 0 is the trajectory's main conversation, 1.. its additional
    histories.
    """

    token_ids: list[int]
    trained: list[bool]
    logprobs: list[float]
    advantage: float = 0.0
    group_index: int = 0
    trajectory_index: int = 0
    history_index: int = 0

    @property
    def num_trained(self) -> int:
        return sum(self.trained)

    def truncated(self, length: int) -> TokenizedSequence:
        """The first ``length`` tokens, with the same labels."""
        return TokenizedSequence(
            token_ids=self.token_ids[:length],
            trained=self.trained[:length],
            logprobs=self.logprobs[:length],
            advantage=self.advantage,
            group_index=self.group_index,
            trajectory_index=self.trajectory_index,
            history_index=self.history_index,
        )


@dataclass
class _Turn:
    """A trained assistant turn: its marker in the rendered text and its token ids."""

    marker: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    from_text: bool = False  # a plain message: ids come from its rendered text


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_message(message: Message) -> dict[str, Any]:
    """The message as chat templates expect it: text content, tool calls as plain dicts."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def turn_closing_text(tokenizer: Any) -> str:
    """What the chat template writes after an assistant turn's content (``<|im_end|>\\n``)."""
    marker = f"<<skytrain-probe-{secrets.token_hex(8)}>>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
        tokenize=False,
    )
    closing = text.partition(marker)[2]
    if not closing:
        raise TrainingError(
            "the base model's chat template writes nothing after an assistant turn, so the "
            "trainer cannot tell where a turn ends: use a chat model whose template closes "
            "assistant turns with an end-of-turn token"
        )
    return str(closing)


def end_of_turn_token_id(tokenizer: Any) -> int:
    """The token a model samples to end its turn: the first token of the template's closing."""
    return _encode(tokenizer, turn_closing_text(tokenizer))[0]


def _overlap(turn_ids: Sequence[int], following_ids: Sequence[int]) -> int:
    """Length of the longest tail of ``turn_ids`` that ``following_ids`` starts with."""
    for size in range(min(len(turn_ids), len(following_ids)), 0, -1):
        if list(turn_ids[-size:]) == list(following_ids[:size]):
            return size
    return 0


def tokenize_history(
    tokenizer: Any,
    history: History,
    *,
    trained_items: Collection[int],
    closing_text: str,
    where: str,
) -> TokenizedSequence:
    """Render ``history`` with its chat template, splicing in sampled ids for trained turns.

    ``trained_items`` are indices into ``messages_and_choices`` of the assistant turns to train
    on. A trained ``Choice`` with token ids contributes exactly those ids (and its logprobs);
    any other trained assistant turn is tokenized from its text.
    """
    nonce = secrets.token_hex(8)
    messages: list[dict[str, Any]] = []
    turns: list[_Turn] = []
    for index, item in enumerate(history.messages_and_choices):
        message = item.message if isinstance(item, Choice) else item
        if index not in trained_items:
            messages.append(_template_message(message))
            continue
        turn = _Turn(marker=f"<<skytrain-turn-{nonce}-{len(turns)}>>")
        sampled_ids = item.sampled_token_ids() if isinstance(item, Choice) else None
        if sampled_ids is not None:
            assert isinstance(item, Choice)
            turn.token_ids = sampled_ids
            turn.logprobs = item.sampled_logprobs() or []
            messages.append({"role": "assistant", "content": turn.marker})
        else:
            turn.from_text = True
            messages.append({**_template_message(message), "content": turn.marker + message.text()})
        turns.append(turn)

    text = str(tokenizer.apply_chat_template(messages, tools=history.tools or None, tokenize=False))
    segments: list[str] = []
    for turn in turns:
        before, found, text = text.partition(turn.marker)
        if not found or turn.marker in text:
            raise TrainingError(
                f"{where}: the chat template did not render each assistant turn exactly once, "
                "so sampled tokens cannot be placed; use a template that renders every message"
            )
        if turn.from_text:
            end = text.find(closing_text)
            if end < 0:
                raise TrainingError(
                    f"{where}: cannot find where an assistant turn ends in the rendered "
                    f"conversation (no {closing_text!r} after it)"
                )
            turn.token_ids = _encode(tokenizer, text[:end]) + _encode(tokenizer, closing_text)[:1]
            turn.logprobs = [math.nan] * len(turn.token_ids)
            text = text[end:]
        segments.append(before)
    segments.append(text)

    token_ids: list[int] = []
    trained: list[bool] = []
    logprobs: list[float] = []
    previous: _Turn | None = None
    for segment, spliced in zip(segments, [*turns, None], strict=True):
        segment_ids = _encode(tokenizer, segment)
        if previous is not None:
            segment_ids = segment_ids[_overlap(previous.token_ids, segment_ids) :]
        token_ids += segment_ids
        trained += [False] * len(segment_ids)
        logprobs += [math.nan] * len(segment_ids)
        if spliced is not None:
            token_ids += spliced.token_ids
            trained += [True] * len(spliced.token_ids)
            logprobs += spliced.logprobs
        previous = spliced
    # Tokens after the last trained one cannot change any trained logprob: drop them.
    last = max((i for i, is_trained in enumerate(trained) if is_trained), default=-1)
    return TokenizedSequence(
        token_ids=token_ids[: last + 1], trained=trained[: last + 1], logprobs=logprobs[: last + 1]
    )


def _where(group_index: int | None, trajectory_index: int, history_index: int) -> str:
    where = f"trajectory {trajectory_index}"
    if group_index is not None:
        where += f" of group {group_index}"
    if history_index:
        where += f" (additional history {history_index - 1})"
    return where


def rl_trained_items(history: History, *, allow_training_without_logprobs: bool) -> set[int]:
    """Sampled choices, plus plain assistant messages when training without logprobs."""
    return {
        index
        for index, item in enumerate(history.messages_and_choices)
        if isinstance(item, Choice)
        or (allow_training_without_logprobs and item.role == "assistant")
    }


def sft_trained_items(history: History, *, assistant_turns: AssistantTurns) -> set[int]:
    """Every assistant turn, or only the last one."""
    indices = [
        index
        for index, item in enumerate(history.messages_and_choices)
        if isinstance(item, Choice) or item.role == "assistant"
    ]
    if assistant_turns == "all":
        return set(indices)
    if assistant_turns == "last":
        return set(indices[-1:])
    raise ValueError(f"assistant_turns must be 'all' or 'last', got {assistant_turns!r}")


@dataclass
class RLBatch:
    """Tokenized sequences with their advantages, and what was left out and why."""

    sequences: list[TokenizedSequence]
    summary: dict[str, float]


def tokenize_rl_groups(
    tokenizer: Any,
    groups: Sequence[TrajectoryGroup],
    *,
    scale_rewards: bool,
    allow_training_without_logprobs: bool,
    keep_zero_variance_groups: bool = False,
) -> RLBatch:
    """Advantages per group, then every history of every trajectory as token ids.

    Groups whose rewards are all equal carry no signal and are skipped (and counted), unless
    ``keep_zero_variance_groups`` (the logprob agreement check wants every sampled token).
    """
    closing_text = turn_closing_text(tokenizer)
    sequences: list[TokenizedSequence] = []
    skipped = 0
    rewards: list[float] = []
    for g, group in enumerate(groups):
        group_rewards = [trajectory.reward for trajectory in group.trajectories]
        rewards += group_rewards
        advantages = group_advantages(group_rewards, scale=scale_rewards)
        if advantages is None:
            skipped += 1
            if not keep_zero_variance_groups:
                continue
            advantages = [0.0] * len(group_rewards)
        for t, (trajectory, advantage) in enumerate(
            zip(group.trajectories, advantages, strict=True)
        ):
            for h, history in enumerate(trajectory.histories()):
                items = rl_trained_items(
                    history, allow_training_without_logprobs=allow_training_without_logprobs
                )
                if not items:
                    continue
                sequence = tokenize_history(
                    tokenizer,
                    history,
                    trained_items=items,
                    closing_text=closing_text,
                    where=_where(g, t, h),
                )
                sequence.advantage = advantage
                sequence.group_index, sequence.trajectory_index = g, t
                sequence.history_index = h
                sequences.append(sequence)
    mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    summary = {
        "groups/total": float(len(groups)),
        "groups/skipped_zero_variance": float(skipped),
        "trajectories/total": float(len(rewards)),
        "train/reward": mean_reward,
        "train/reward_std": math.sqrt(
            sum((r - mean_reward) ** 2 for r in rewards) / len(rewards) if rewards else 0.0
        ),
    }
    return RLBatch(sequences=sequences, summary=summary)


def tokenize_sft_trajectories(
    tokenizer: Any, trajectories: Sequence[Trajectory], *, assistant_turns: AssistantTurns
) -> list[TokenizedSequence]:
    """Every history of every trajectory with its assistant turns (all or last) trained."""
    closing_text = turn_closing_text(tokenizer)
    sequences = []
    for t, trajectory in enumerate(trajectories):
        for h, history in enumerate(trajectory.histories()):
            items = sft_trained_items(history, assistant_turns=assistant_turns)
            if not items:
                if h == 0:
                    raise TrainingError(
                        f"{_where(None, t, h)} has no assistant turn to learn from: SFT needs "
                        "at least one assistant message per trajectory"
                    )
                continue
            sequence = tokenize_history(
                tokenizer,
                history,
                trained_items=items,
                closing_text=closing_text,
                where=_where(None, t, h),
            )
            sequence.group_index, sequence.trajectory_index = t, t
            sequence.history_index = h
            sequences.append(sequence)
    return sequences
