"""Which interpreter runs the worker's trainer: the Unsloth trainer's environment where
Unsloth runs, else torch + peft in the worker's own process.

Unsloth cannot share vLLM 0.34's environment (every Unsloth release caps transformers at
5.17, whose huggingface-hub < 2.0 vLLM 0.34 cannot use), but it resolves in a venv of its
own (``scripts/unsloth-constraints.txt``), which sky/worker.yaml's setup builds on a node of
one GPU (``~/skytrain-unsloth``) or ``SKYTRAIN_UNSLOTH_PYTHON`` names. The worker then runs
each job's trainer as a process of its own under that interpreter (``worker.sharded``'s
trainer with one rank; ``trainer.model`` loads the base with Unsloth there), and only where
Unsloth is the one-GPU path: on CUDA, the trainer on one GPU (a sharded trainer is FSDP over
peft), not forced onto the CPU. Tinker runs keep the in-process trainer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# Where sky/worker.yaml's setup builds the Unsloth trainer's environment.
DEFAULT_UNSLOTH_PYTHON = Path.home() / "skytrain-unsloth" / "bin" / "python"


def trainer_python(
    named: str | None,
    *,
    cuda: bool,
    trainer_shards: int,
    device: str | None,
    default: Path = DEFAULT_UNSLOTH_PYTHON,
) -> str | None:
    """The Unsloth environment's interpreter (``named``, else ``default`` where it exists)
    when the trainer would use Unsloth: CUDA, one trainer process, no CPU device; None for the
    in-process torch + peft trainer."""
    if not cuda or trainer_shards != 1 or device == "cpu":
        if named:
            logger.info("not using the Unsloth environment: the trainer is not on one GPU")
        return None
    path = Path(named) if named else default
    if not (path.is_file() and os.access(path, os.X_OK)):
        if named:
            logger.warning(
                "SKYTRAIN_UNSLOTH_PYTHON names no interpreter this worker can run: the "
                "trainer uses torch + peft"
            )
        return None
    logger.info("the trainer runs in the Unsloth environment (%s)", path)
    return str(path)
