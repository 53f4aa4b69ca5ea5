"""Unsloth patches transformers, peft and trl when it is imported, and loses its optimisations
when it comes after them: a vLLM worker imports it first. That only holds while starting a
worker imports none of them before ``import_unsloth_first`` runs."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_worker_entry_point_imports_no_training_library_before_unsloth() -> None:
    code = (
        "import sys, skytrain_backend.cli, skytrain_backend.worker.main, "
        "skytrain_backend.engine.options, skytrain_backend.engine.launcher; "
        "print(sorted({'transformers', 'peft', 'trl', 'torch'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
