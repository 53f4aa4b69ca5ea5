"""The demo's RL loop, written against the SDK alone, as a user would write it.

Each step samples ``rollouts_per_group`` answers to each of ``groups_per_step`` training
questions through the model's OpenAI endpoint, scores them, trains one GRPO step on them, and
evaluates the new checkpoint on the held-out questions (logged with ``split="val"``). Every
answer is sampled with a seed derived from the run's ``--seed``, so a run repeats itself on
one machine (up to the floating-point noise of batching), and every step is evaluated on the
same seeds.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import skytrain
from skytrain_backend.demo import task


@dataclass(frozen=True)
class LoopOptions:
    """What one demo run trains with (``skytrain demo --help`` documents each)."""

    steps: int
    groups_per_step: int
    rollouts_per_group: int
    learning_rate: float
    seed: int
    eval_questions: int
    # Tuned with the task (see README, "The demo"); not worth a command-line option each.
    eval_samples: int = 2
    max_tokens: int = 16
    temperature: float = 1.0


@dataclass(frozen=True)
class StepRow:
    """One line of the demo's table. Step 0 is the base model: evaluated, not trained."""

    step: int
    train_reward: float | None
    eval_reward: float
    eval_one_word: float
    eval_correct: float
    seconds: float


def sampling_seed(*parts: object) -> int:
    """A seed for one sampled answer, the same in every run for the same ``parts`` (a string
    seeds ``random`` through SHA-512, whatever the interpreter's hash seed)."""
    return random.Random("/".join(map(str, parts))).getrandbits(31)


async def rollout(
    model: skytrain.Model,
    question: task.Question,
    *,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> skytrain.Trajectory:
    """One answer to ``question`` from the model's endpoint, sampled with ``seed``, scored."""
    messages = question.messages()
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    choice = completion.choices[0]
    result = task.score(question, choice.message.content or "", finish_reason=choice.finish_reason)
    return skytrain.Trajectory(
        messages_and_choices=[*messages, choice],
        reward=result.reward,
        metrics=result.metrics(),
        metadata={"question": question.text},
    )


def _mean(groups: Sequence[skytrain.TrajectoryGroup], metric: str | None = None) -> float:
    trajectories = [t for group in groups for t in group.trajectories]
    if metric is None:
        return statistics.fmean(t.reward for t in trajectories)
    return statistics.fmean(float(t.metrics[metric]) for t in trajectories)


async def _gather(
    model: skytrain.Model,
    questions: Sequence[task.Question],
    *,
    per_question: int,
    options: LoopOptions,
    seeds: str,
    desc: str,
) -> list[skytrain.TrajectoryGroup]:
    """``per_question`` answers to each question, the j-th answer to a question sampled with
    the seed of (the run's seed, ``seeds``, the question, j)."""
    return await skytrain.gather_trajectory_groups(
        (
            skytrain.TrajectoryGroup(
                rollout(
                    model,
                    question,
                    max_tokens=options.max_tokens,
                    temperature=options.temperature,
                    seed=sampling_seed(options.seed, seeds, question.text, j),
                )
                for j in range(per_question)
            )
            for question in questions
        ),
        pbar_desc=desc,
    )


def training_batches(
    questions: Sequence[task.Question], *, steps: int, per_step: int, seed: int
) -> list[list[task.Question]]:
    """The questions of each step: the training set shuffled by ``seed``, taken in turn."""
    order = list(questions)
    random.Random(seed).shuffle(order)
    return [
        [order[(step * per_step + i) % len(order)] for i in range(per_step)]
        for step in range(steps)
    ]


async def train(
    model: skytrain.TrainableModel,
    options: LoopOptions,
    *,
    on_row: Callable[[StepRow], None],
) -> list[StepRow]:
    """Evaluate the base model, then train and evaluate ``options.steps`` times."""
    train_questions, held_out = task.split_questions()
    held_out = held_out[: options.eval_questions]
    config = skytrain.TrainConfig(learning_rate=options.learning_rate, seed=options.seed)
    rows: list[StepRow] = []

    async def evaluate(step: int, started: float, train_reward: float | None) -> None:
        # Every step is evaluated with the same seeds, so two steps' rewards differ by what the
        # model learned, not by the luck of their samples.
        groups = await _gather(
            model,
            held_out,
            per_question=options.eval_samples,
            options=options,
            seeds="eval",
            desc=f"step {step} eval",
        )
        await model.log(groups, split="val")
        rows.append(
            StepRow(
                step=step,
                train_reward=train_reward,
                eval_reward=_mean(groups),
                eval_one_word=_mean(groups, "one_word"),
                eval_correct=_mean(groups, "correct"),
                seconds=time.monotonic() - started,
            )
        )
        on_row(rows[-1])

    first_step = await model.get_step()
    await evaluate(first_step, time.monotonic(), None)
    batches = training_batches(
        train_questions, steps=options.steps, per_step=options.groups_per_step, seed=options.seed
    )
    for questions in batches:
        started = time.monotonic()
        step = rows[-1].step + 1
        groups = await _gather(
            model,
            questions,
            per_question=options.rollouts_per_group,
            options=options,
            seeds=f"step {step}",
            desc=f"step {step} rollouts",
        )
        result = await model.train(groups, config=config)
        await evaluate(result.step, started, _mean(groups))
    return rows
