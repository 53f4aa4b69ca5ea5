"""Trajectories to the exact token ids the policy saw and produced.

The trainer must learn from the tokens the engine sampled, after the prompt the engine saw, not
from a re-tokenization of their text: "Hello" sampled as ``Hel`` + ``lo`` is a different event,
with a different logprob, than the single token ``Hello``; and a later turn's prompt is what the
engine rendered for *that* request, which need not be the earlier prompt plus the earlier
sampled tokens (a turn tokenized differently when its text is rendered again, a tool call
written with other whitespace than the template's, a template that rewrites earlier assistant
turns, as Qwen3's drops their think blocks).

RL (``tokenize_rl_groups``): each trained turn is its prompt ids followed by its sampled ids.
The prompt ids are the choice's ``prompt_token_ids`` (the engine's, which skytrain's endpoints
return on every choice); without them (older clients, hand-made choices) the prompt is rendered
exactly as the engine renders a request: the messages before the turn, the history's tools,
``add_generation_prompt=True``. A turn whose prompt extends the tokens so far (earlier prompts
and turns) continues the same sequence; one whose prompt does not starts a new sequence of its
own, so no turn is ever trained after a context the sampler did not see. The packer shares
what prefix such sequences have in common.

Assistant turns given as plain messages (or choices without token ids) are context unless the
caller trains on them (``allow_training_without_logprobs``): then their tokens are the
template's rendering of their text up to and including its end-of-turn token (that is how the
model learns to stop), and their logprobs are unknown (NaN: the trainer computes them once
before its first step).

SFT (``tokenize_sft_trajectories``): each conversation is rendered whole with its chat template,
every trained assistant turn replaced by a unique marker; the text between markers is tokenized
as the engine tokenizes a prompt, and each marker becomes the turn's token ids (sampled ids
where a choice has them, else its text up to the end-of-turn token).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from skytrain_backend.chat_template import ToolSpec, template_message, template_tools
from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import Choice, History, Message, Trajectory, TrajectoryGroup
from skytrain_backend.trainer.advantages import balance_advantages, group_advantages

AssistantTurns = Literal["all", "last"]


@dataclass
class TokenizedSequence:
    """One conversation as token ids, with which of them are trained and their sampling logprobs.

    ``logprobs[i]`` is the engine's logprob of ``token_ids[i]`` where it sampled that token, NaN
    elsewhere. ``history_index`` 0 is the trajectory's main conversation, 1.. its additional
    histories. ``weight`` multiplies each trained token's loss (1, except under ART's
    aggregation: ``advantages.art_weights``).
    """

    token_ids: list[int]
    trained: list[bool]
    logprobs: list[float]
    advantage: float = 0.0
    weight: float = 1.0
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
            weight=self.weight,
            group_index=self.group_index,
            trajectory_index=self.trajectory_index,
            history_index=self.history_index,
        )


@dataclass
class _MarkedTurn:
    """SFT: a trained assistant turn, its marker in the rendered text and its token ids."""

    marker: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    from_text: bool = False  # a plain message: ids come from its rendered text


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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


def tokenize_sft_history(
    tokenizer: Any,
    history: History,
    *,
    trained_items: Collection[int],
    closing_text: str,
    where: str,
) -> TokenizedSequence:
    """SFT: render ``history`` with its chat template, with the trained turns' ids in place.

    ``trained_items`` are indices into ``messages_and_choices`` of the assistant turns to train
    on. A trained ``Choice`` with token ids contributes exactly those ids (and its logprobs);
    any other trained assistant turn is tokenized from its text.
    """
    nonce = secrets.token_hex(8)
    messages: list[dict[str, Any]] = []
    turns: list[_MarkedTurn] = []
    for index, item in enumerate(history.messages_and_choices):
        message = item.message if isinstance(item, Choice) else item
        if index not in trained_items:
            messages.append(template_message(message))
            continue
        turn = _MarkedTurn(marker=f"<<skytrain-turn-{nonce}-{len(turns)}>>")
        sampled_ids = item.sampled_token_ids() if isinstance(item, Choice) else None
        if sampled_ids is not None:
            assert isinstance(item, Choice)
            turn.token_ids = sampled_ids
            turn.logprobs = item.sampled_logprobs() or []
            messages.append({"role": "assistant", "content": turn.marker})
        else:
            turn.from_text = True
            messages.append({**template_message(message), "content": turn.marker + message.text()})
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
    previous: _MarkedTurn | None = None
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


def _tools(history: History, where: str) -> list[Any] | None:
    """The history's tools as the engine hands them to the template."""
    try:
        specs = [ToolSpec.model_validate(tool) for tool in history.tools or []]
    except ValidationError as exc:
        raise TrainingError(
            f"{where}: its tools are not OpenAI function tools ({exc.errors()[0]['msg']}): "
            "send them as the model's endpoint took them"
        ) from None
    return template_tools(specs)


class _Renderer:
    """One history's messages rendered as the engine renders a request's."""

    def __init__(self, tokenizer: Any, history: History, *, where: str) -> None:
        self._tokenizer = tokenizer
        self._messages = [
            template_message(item.message if isinstance(item, Choice) else item)
            for item in history.messages_and_choices
        ]
        self._tools = _tools(history, where)

    def text(self, end: int, *, add_generation_prompt: bool) -> str:
        return str(
            self._tokenizer.apply_chat_template(
                self._messages[:end],
                tools=self._tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        )

    def prompt_ids(self, index: int) -> list[int]:
        """The engine's prompt for a turn at ``messages_and_choices[index]``."""
        return _encode(self._tokenizer, self.text(index, add_generation_prompt=True))


@dataclass
class _Turn:
    """One trained assistant turn: the prompt it was sampled after and its tokens."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


def _text_turn(
    renderer: _Renderer, index: int, *, closing_text: str, tokenizer: Any, where: str
) -> list[int]:
    """The tokens of an assistant message trained from its text: the template's rendering of
    it after the generation prompt, up to and including its end-of-turn token."""
    prompt = renderer.text(index, add_generation_prompt=True)
    whole = renderer.text(index + 1, add_generation_prompt=False)
    end = whole.find(closing_text, len(prompt))
    if not whole.startswith(prompt) or end < 0:
        raise TrainingError(
            f"{where}: the chat template does not render the assistant message at "
            f"messages_and_choices[{index}] after its generation prompt, so its tokens cannot be "
            "told apart: train on choices sampled from the model's endpoint instead"
        )
    return _encode(tokenizer, whole[len(prompt) : end]) + _encode(tokenizer, closing_text)[:1]


def _rl_turn(
    item: Message | Choice,
    index: int,
    renderer: _Renderer,
    *,
    tokenizer: Any,
    closing_text: str,
    where: str,
) -> _Turn:
    sampled = item.sampled_token_ids() if isinstance(item, Choice) else None
    if isinstance(item, Choice) and item.prompt_token_ids is not None:
        prompt = list(item.prompt_token_ids)
    else:
        prompt = renderer.prompt_ids(index)
    if sampled is None:
        ids = _text_turn(
            renderer, index, closing_text=closing_text, tokenizer=tokenizer, where=where
        )
        return _Turn(prompt, ids, [math.nan] * len(ids))
    assert isinstance(item, Choice)
    logprobs = item.sampled_logprobs()
    return _Turn(prompt, sampled, logprobs if logprobs is not None else [math.nan] * len(sampled))


def tokenize_rl_history(
    tokenizer: Any,
    history: History,
    *,
    trained_items: Collection[int],
    closing_text: str,
    where: str,
) -> list[TokenizedSequence]:
    """The trained turns of ``history`` on their own prompts: one sequence while each turn's
    prompt extends the tokens before it, a new one where it does not."""
    renderer = _Renderer(tokenizer, history, where=where)
    sequences: list[TokenizedSequence] = []
    current: TokenizedSequence | None = None
    for index in sorted(trained_items):
        turn = _rl_turn(
            history.messages_and_choices[index],
            index,
            renderer,
            tokenizer=tokenizer,
            closing_text=closing_text,
            where=where,
        )
        so_far = current.token_ids if current is not None else []
        if current is None or turn.prompt_ids[: len(so_far)] != so_far:
            current = TokenizedSequence(token_ids=[], trained=[], logprobs=[])
            sequences.append(current)
        context = turn.prompt_ids[len(current.token_ids) :]
        current.token_ids += context + turn.token_ids
        current.trained += [False] * len(context) + [True] * len(turn.token_ids)
        current.logprobs += [math.nan] * len(context) + turn.logprobs
    return sequences


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
    advantage_balance: float = 0.0,
    keep_zero_variance_groups: bool = False,
    art_rules: bool = False,
) -> RLBatch:
    """Advantages per group, then every history of every trajectory as token ids.

    Groups whose rewards are all equal (to float noise) carry no signal and are skipped (and
    counted), unless ``keep_zero_variance_groups``. With ``art_rules``, ART's: rewards are
    equal within 1e-12 of the group's first, and a trajectory whose advantage is exactly 0
    (its reward is the group's mean) is left out too (counted).
    """
    closing_text = turn_closing_text(tokenizer)
    sequences: list[TokenizedSequence] = []
    skipped = zero_advantage = 0
    rewards: list[float] = []
    for g, group in enumerate(groups):
        group_rewards = [trajectory.reward for trajectory in group.trajectories]
        rewards += group_rewards
        advantages = group_advantages(group_rewards, scale=scale_rewards, art_rule=art_rules)
        if advantages is None:
            skipped += 1
            if not keep_zero_variance_groups:
                continue
            advantages = [0.0] * len(group_rewards)
        # ART drops them before advantage_balance, which can zero an advantage it keeps.
        dropped = {t for t, a in enumerate(advantages) if a == 0} if art_rules else set()
        zero_advantage += len(dropped)
        advantages = balance_advantages(advantages, balance=advantage_balance)
        for t, (trajectory, advantage) in enumerate(
            zip(group.trajectories, advantages, strict=True)
        ):
            if t in dropped:
                continue
            for h, history in enumerate(trajectory.histories()):
                items = rl_trained_items(
                    history, allow_training_without_logprobs=allow_training_without_logprobs
                )
                for sequence in tokenize_rl_history(
                    tokenizer,
                    history,
                    trained_items=items,
                    closing_text=closing_text,
                    where=_where(g, t, h),
                ):
                    sequence.advantage = advantage
                    sequence.group_index, sequence.trajectory_index = g, t
                    sequence.history_index = h
                    sequences.append(sequence)
    mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    summary = {
        "groups/total": float(len(groups)),
        "groups/skipped_zero_variance": float(skipped),
        "trajectories/skipped_zero_advantage": float(zero_advantage),
        "trajectories/total": float(len(rewards)),
        "sequences/total": float(len(sequences)),
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
            sequence = tokenize_sft_history(
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
