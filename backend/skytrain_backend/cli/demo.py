"""``skytrain demo``: train SmolLM2 with GRPO on this machine and plot the reward."""

from __future__ import annotations

from pathlib import Path

import typer

from skytrain_backend.cli._common import _fail, _interruptible, app


@app.command()
def demo(
    steps: int = typer.Option(12, min=1, help="GRPO training steps."),
    groups_per_step: int = typer.Option(8, min=1, help="Training questions per step."),
    rollouts_per_group: int = typer.Option(
        4, min=2, help="Answers sampled per question (GRPO compares them)."
    ),
    learning_rate: float = typer.Option(5e-4, help="Learning rate of the LoRA update."),
    seed: int = typer.Option(
        0, help="Seed of the question order, of every sampled answer and of training."
    ),
    eval_questions: int = typer.Option(
        16, min=1, max=16, help="Held-out questions evaluated after each step."
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

    An embedded control plane and a local worker; the task: answer with one word. Prints a
    table, writes a PNG of the rewards, and stops everything at the end or on Ctrl-C.
    """
    import skytrain
    from skytrain_backend.config import get_settings
    from skytrain_backend.demo import DemoOptions, LoopOptions, run_demo
    from skytrain_backend.errors import SkytrainError

    _interruptible()
    if not learning_rate > 0:
        raise typer.BadParameter(f"{learning_rate} is not positive", param_hint="--learning-rate")
    options = DemoOptions(
        loop=LoopOptions(
            steps=steps,
            groups_per_step=groups_per_step,
            rollouts_per_group=rollouts_per_group,
            learning_rate=learning_rate,
            seed=seed,
            eval_questions=eval_questions,
        ),
        base_model=base_model,
        home=home.expanduser().resolve(),
        output_dir=output_dir.expanduser().resolve() if output_dir else None,
        port=port,
        model_cache_dir=get_settings().resolved_model_cache_dir,
    )
    try:
        run_demo(options)
    except KeyboardInterrupt:
        typer.echo("interrupted: the control plane and its workers are stopped", err=True)
        raise typer.Exit(code=130) from None
    except (SkytrainError, skytrain.SkytrainError) as exc:
        raise _fail(str(exc)) from None
