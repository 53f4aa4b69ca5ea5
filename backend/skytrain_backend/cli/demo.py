"""``skytrain demo``: train SmolLM2 with GRPO on this machine and plot the reward."""

from __future__ import annotations

import enum
from pathlib import Path

import typer

from skytrain_backend.cli._common import _fail, _interruptible, app


class Task(enum.StrEnum):
    """The names of ``skytrain_backend.demo.tasks.TASKS`` (kept here so that ``--help`` needs
    no import of the demo; a test checks that the two agree)."""

    one_word = "one-word"
    tic_tac_toe = "tic-tac-toe"
    game_2048 = "2048"
    temporal_clue = "temporal-clue"


@app.command()
def demo(
    task: Task = typer.Option(
        Task.one_word,
        help=(
            "What the model learns. one-word: answer a question with one word. The seed's "
            "games, as in examples/ (same prompts, rules, formats), trained on a shaped reward "
            "because the game's own is too sparse for a 135M model (the game's own shows as "
            "the 'score' column): tic-tac-toe against a random opponent, the free cells listed "
            "after each board (each move: legal, taking a win or blocking one; plus the "
            "outcome), 2048 for 8 moves (each move: "
            "valid, merging tiles), temporal-clue (the answer format, plus the share right). "
            "A move the game cannot read still ends it, with credit for how near it came to "
            "the format (tags, a cell or direction, at most three words). Each task has its "
            "own recipe (steps, learning rate, ...): the options below override it."
        ),
        case_sensitive=False,
    ),
    steps: int | None = typer.Option(
        None, min=1, help="GRPO training steps. [default: the task's recipe]"
    ),
    groups_per_step: int | None = typer.Option(
        None,
        min=1,
        help="Training questions (or games, puzzles) per step. [default: the task's recipe]",
    ),
    rollouts_per_group: int | None = typer.Option(
        None,
        min=2,
        help=(
            "Rollouts sampled per question or game (GRPO compares them). "
            "[default: the task's recipe]"
        ),
    ),
    learning_rate: float | None = typer.Option(
        None, help="Learning rate of the LoRA update. [default: the task's recipe]"
    ),
    temperature: float | None = typer.Option(
        None,
        max=2.0,
        help="Sampling temperature, above 0 and at most 2. [default: the task's recipe]",
    ),
    seed: int = typer.Option(
        0, help="Seed of the question (game) order, of every sampled answer and of training."
    ),
    eval_questions: int = typer.Option(
        16, min=1, max=16, help="Held-out questions (games, puzzles) evaluated after each step."
    ),
    output_dir: Path | None = typer.Option(
        None, help="Where the plot and table go. [default: HOME/runs/<time>]"
    ),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="Port of the embedded control plane. [default: a free one]"
    ),
    base_model: str = typer.Option(
        "HuggingFaceTB/SmolLM2-135M-Instruct", help="Any Hugging Face model id or local directory."
    ),
    home: Path = typer.Option(
        Path("~/.skytrain/demo"), help="The demo's database, objects and worker logs."
    ),
) -> None:
    """Train SmolLM2-135M-Instruct with GRPO here, then plot its reward per step.

    An embedded control plane and a local worker; the task (--task): answer with one word, or
    play one of the seed's games. Prints a table, writes a PNG of the rewards, and stops
    everything at the end or on Ctrl-C.
    """
    import skytrain
    from skytrain_backend.config import get_settings
    from skytrain_backend.demo import DemoOptions, LoopOptions, run_demo
    from skytrain_backend.demo.tasks import get_task
    from skytrain_backend.errors import SkytrainError

    _interruptible()
    if learning_rate is not None and not learning_rate > 0:
        raise typer.BadParameter(f"{learning_rate} is not positive", param_hint="--learning-rate")
    if temperature is not None and not temperature > 0:
        raise typer.BadParameter(f"{temperature} is not positive", param_hint="--temperature")
    chosen = get_task(task.value)
    recipe = chosen.recipe
    options = DemoOptions(
        loop=LoopOptions(
            steps=recipe.steps if steps is None else steps,
            groups_per_step=recipe.groups_per_step if groups_per_step is None else groups_per_step,
            rollouts_per_group=(
                recipe.rollouts_per_group if rollouts_per_group is None else rollouts_per_group
            ),
            learning_rate=recipe.learning_rate if learning_rate is None else learning_rate,
            seed=seed,
            eval_questions=eval_questions,
            temperature=recipe.temperature if temperature is None else temperature,
        ),
        task=chosen,
        base_model=base_model,
        home=home.expanduser().resolve(),
        output_dir=output_dir.expanduser().resolve() if output_dir else None,
        port=port,
        model_cache_dir=get_settings().storage.resolved_model_cache_dir,
    )
    try:
        run_demo(options)
    except KeyboardInterrupt:
        typer.echo("interrupted: the control plane and its workers are stopped", err=True)
        raise typer.Exit(code=130) from None
    except (SkytrainError, skytrain.SkytrainError) as exc:
        raise _fail(str(exc)) from None
