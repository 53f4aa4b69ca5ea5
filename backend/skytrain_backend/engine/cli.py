"""``skytrain engine serve``: run an inference engine in the foreground.

Only typer is imported here; the engine itself (torch, transformers, vLLM) is imported inside
the command, so ``skytrain --help`` stays fast.
"""

from __future__ import annotations

import os

import typer

engine_app = typer.Typer(
    name="engine",
    help="Run an inference engine (vLLM on CUDA, skytrain's CPU engine elsewhere).",
    no_args_is_help=True,
)


@engine_app.callback()
def _engine_group() -> None:
    """Run an inference engine (vLLM on CUDA, skytrain's CPU engine elsewhere)."""


@engine_app.command()
def serve(
    model: str = typer.Option(..., help="Hugging Face model id or local directory."),
    served_model_name: str | None = typer.Option(
        None, help="Name the base model is served under. Default: --model as given."
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: str | None = typer.Option(
        None,
        help="Require 'Authorization: Bearer KEY' on /v1 routes. "
        "Default: $SKYTRAIN_ENGINE_SECRET when set, else no key.",
    ),
    engine: str | None = typer.Option(
        None, help="auto (vLLM with CUDA, else hf) | vllm | hf. Default: $SKYTRAIN_ENGINE."
    ),
    max_model_len: int | None = typer.Option(
        None, help="Longest prompt + completion, in tokens. Default: the model's context length."
    ),
    max_num_seqs: int | None = typer.Option(
        None, help="Most sequences decoded together (CPU engine default: 32)."
    ),
    dtype: str = typer.Option(
        "auto", help="auto | float32 | bfloat16 | float16 (auto: float32 on CPU)."
    ),
    threads: int | None = typer.Option(
        None, min=1, help="CPU engine: torch threads. Default: half the CPU cores."
    ),
    max_lora_rank: int | None = typer.Option(
        None,
        min=1,
        help="Largest LoRA rank of an adapter it loads. Default: $SKYTRAIN_ENGINE_MAX_LORA_RANK.",
    ),
    log_level: str = typer.Option("info", help="debug | info | warning | error."),
) -> None:
    """Serve a base model and its LoRA adapters over vLLM's OpenAI-compatible HTTP API."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.engine.options import EngineOptions, select_engine
    from skytrain_backend.errors import SkytrainError

    settings = get_settings()
    try:
        kind = select_engine(
            engine or settings.engine.kind, vllm_python=settings.engine.vllm_python
        )
        options = EngineOptions.from_settings(
            settings,
            model=model,
            port=port,
            served_model_name=served_model_name,
            host=host,
            api_key=api_key or settings.engine.secret,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            threads=threads,
            max_lora_rank=max_lora_rank,
        )
        if kind == "vllm":
            from skytrain_backend.engine.vllm import vllm_engine_command

            command = vllm_engine_command(options)
            os.execve(command.argv[0], command.argv, os.environ | command.env)
        from skytrain_backend.engine.hf.server import serve as serve_hf

        serve_hf(options, log_level=log_level)
    except SkytrainError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(code=1) from None
