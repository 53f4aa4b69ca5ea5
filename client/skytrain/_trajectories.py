"""Trajectories (scored rollouts) and the groups they are trained in, in ART's JSON shape.

``messages_and_choices`` mixes chat message dicts (context the agent was given or wrote
itself) with the OpenAI ``Choice`` objects the model's endpoint returned. The choices are kept
exactly as returned, logprobs and sampled token ids included, because the trainer learns from
those tokens rather than re-tokenizing the text. ``model_dump(mode="json")`` is the JSON the
server's parser reads.

A ``TrajectoryGroup`` may be built from rollout coroutines instead of finished trajectories;
awaiting it (or passing it to ``gather_trajectory_groups``) runs them concurrently. A rollout
that raises is recorded in ``exceptions`` and left out; beyond the allowed number of failures
the first one is raised and the rollouts still running are cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Awaitable, Coroutine, Generator, Iterable, Mapping
from typing import Annotated, Any, TypeVar, cast

from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetPydanticSchema,
    PrivateAttr,
    Tag,
    field_validator,
)
from pydantic_core import core_schema

from skytrain._progress import _current_tally, _RolloutTally
from skytrain._types import INT32_MAX
from skytrain._wire import _JSONObject

Message = ChatCompletionMessageParam
MessageOrChoice = Message | Choice
Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[ChatCompletionToolParam]

Metrics = dict[str, float | int | bool]

_T = TypeVar("_T")


def _check_message(value: Any) -> Any:
    if isinstance(value, Mapping) and "role" in value:
        return value
    if isinstance(value, BaseModel) and isinstance(getattr(value, "role", None), str):
        return value  # e.g. an openai ChatCompletionMessage appended to the history
    raise ValueError(
        f"expected a chat message (a dict with a 'role') or an openai Choice, "
        f"got {type(value).__name__}"
    )


def _check_tools(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(tool, Mapping) for tool in value):
        return value
    raise ValueError("tools must be a list of OpenAI tool definitions (dicts)")


# Messages and tools are the user's dicts, kept as they are (no copy, no field stripped); they
# are only checked for shape here, and validated in full by the server.
_MessageField = Annotated[
    ChatCompletionMessageParam,
    GetPydanticSchema(lambda _t, _h: core_schema.no_info_plain_validator_function(_check_message)),
]
_ToolsField = Annotated[
    list[ChatCompletionToolParam],
    GetPydanticSchema(lambda _t, _h: core_schema.no_info_plain_validator_function(_check_tools)),
]


def _message_or_choice(value: Any) -> str:
    if isinstance(value, Choice):
        return "choice"
    if isinstance(value, Mapping) and "message" in value and "role" not in value:
        return "choice"  # a Choice read back from JSON
    return "message"


_MessagesAndChoicesField = list[
    Annotated[
        Annotated[_MessageField, Tag("message")] | Annotated[Choice, Tag("choice")],
        Discriminator(_message_or_choice),
    ]
]


def _finite_metrics(metrics: Metrics) -> Metrics:
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metric {key!r} is {value}: metrics must be finite numbers")
    return metrics


def _as_message(item: MessageOrChoice) -> Message:
    if isinstance(item, Choice):
        message: dict[str, Any] = {"role": "assistant", "content": item.message.content}
        if item.message.tool_calls:
            message["tool_calls"] = [
                call.model_dump(mode="json", exclude_none=True) for call in item.message.tool_calls
            ]
        return cast(Message, message)
    if isinstance(item, BaseModel):
        return cast(Message, item.model_dump(mode="json", exclude_none=True))
    return item


class History(BaseModel):
    """Another conversation of the same rollout (a sub-agent's, a summarizer's...).

    It is trained with the reward of the trajectory it belongs to.
    """

    model_config = ConfigDict(validate_assignment=True)

    messages_and_choices: _MessagesAndChoicesField
    tools: _ToolsField | None = None

    def messages(self) -> Messages:
        """The conversation as plain message dicts; choices become assistant messages."""
        return [_as_message(item) for item in self.messages_and_choices]


class Trajectory(BaseModel):
    """One scored rollout: the conversation, its reward, and what the user wants to log."""

    model_config = ConfigDict(validate_assignment=True)

    messages_and_choices: _MessagesAndChoicesField
    reward: float = Field(allow_inf_nan=False)
    # ART's: the model's step when the rollout began. The step a group was sampled from is
    # the oldest its choices (``skytrain_step``) or this say, for ``max_off_policy_steps``.
    initial_policy_version: int | None = Field(default=None, ge=0, le=INT32_MAX)
    metrics: Metrics = Field(default_factory=dict)
    metadata: _JSONObject = Field(default_factory=dict)
    tools: _ToolsField | None = None
    additional_histories: list[History] = Field(default_factory=list)
    logs: list[str] = Field(default_factory=list)

    _check_metrics = field_validator("metrics")(_finite_metrics)

    def messages(self) -> Messages:
        """The conversation as plain message dicts; choices become assistant messages.

        Tool calls the model made are kept, so the list can be sent back to any
        OpenAI-compatible endpoint to continue the conversation.
        """
        return [_as_message(item) for item in self.messages_and_choices]


class RolloutException(BaseModel):
    """A rollout that raised, kept in its group so the failure can be inspected and logged."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exception: BaseException) -> RolloutException:
        return cls(
            type=f"{type(exception).__module__}.{type(exception).__qualname__}",
            message=str(exception),
            traceback="".join(traceback.format_exception(exception)),
        )


async def _gather_or_cancel(coroutines: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run concurrently; on the first error cancel the rest, wait for them, and raise it."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class TrajectoryGroup(BaseModel):
    """Rollouts of one scenario: the trainer compares rewards within a group.

    Build it from finished trajectories, or from rollout awaitables and then await it (or
    hand it to ``gather_trajectory_groups``). Exceptions (and exception objects found among
    ``trajectories``) are recorded as ``RolloutException`` entries.
    """

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[RolloutException] = Field(default_factory=list)
    metadata: _JSONObject = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)
    _check_metrics = field_validator("metrics")(_finite_metrics)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory] | BaseException] = (),
        *,
        exceptions: Iterable[BaseException | RolloutException] = (),
        metadata: _JSONObject | None = None,
        metrics: Metrics | None = None,
        logs: list[str] | None = None,
    ) -> None:
        finished: list[Trajectory] = []
        pending: list[Awaitable[Trajectory]] = []
        failed: list[BaseException | RolloutException] = []
        for index, item in enumerate(trajectories):
            if isinstance(item, Trajectory):
                finished.append(item)
            elif isinstance(item, BaseException):
                failed.append(item)
            elif inspect.isawaitable(item):
                pending.append(item)
            else:
                raise TypeError(
                    f"trajectories[{index}] is a {type(item).__name__}: pass skytrain.Trajectory "
                    "objects or awaitables (rollout coroutines) that return them"
                )
        super().__init__(
            trajectories=finished,
            exceptions=[
                item
                if isinstance(item, RolloutException)
                else RolloutException.from_exception(item)
                for item in [*failed, *exceptions]
            ],
            metadata=metadata or {},
            metrics=metrics or {},
            logs=logs or [],
        )
        self._pending = pending

    def __len__(self) -> int:
        return len(self.trajectories)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self._resolve().__await__()

    @property
    def is_resolved(self) -> bool:
        """False while rollouts given as awaitables have not been run (await the group)."""
        return not self._pending

    async def _resolve(self) -> TrajectoryGroup:
        pending = self._take_pending()
        tally = _current_tally.get() or _RolloutTally(bar=None, max_exceptions=0)
        tally.expect(len(pending))
        await self._run_rollouts(pending, tally)
        return self

    def _take_pending(self) -> list[Awaitable[Trajectory]]:
        pending, self._pending = self._pending, []
        return pending

    async def _run_rollouts(
        self, pending: list[Awaitable[Trajectory]], tally: _RolloutTally
    ) -> None:
        async def run(rollout: Awaitable[Trajectory]) -> Trajectory | None:
            try:
                trajectory = await rollout
            except Exception as exc:
                self.exceptions.append(RolloutException.from_exception(exc))
                tally.rollout_failed(exc)
                return None
            if not isinstance(trajectory, Trajectory):
                raise TypeError(
                    f"a rollout returned a {type(trajectory).__name__}: rollouts must return "
                    "a skytrain.Trajectory"
                )
            tally.trajectory_done(id(trajectory), trajectory.reward)
            return trajectory

        results = await _gather_or_cancel(run(rollout) for rollout in pending)
        self.trajectories.extend(trajectory for trajectory in results if trajectory is not None)
