"""Unsloth patches transformers, peft and trl when it is imported, and loses its optimisations
when it comes after them: a vLLM worker imports it first. That only holds while starting a
worker imports none of them before ``import_unsloth_first`` runs."""

from __future__ import annotations

import pytest

from tests.fixtures.imports import loaded_by_importing


@pytest.mark.slow
def test_the_worker_entry_point_imports_no_training_library_before_unsloth() -> None:
    entry_point = (
        "skytrain_backend.cli, skytrain_backend.worker.main, "
        "skytrain_backend.engine.options, skytrain_backend.engine.launcher"
    )
    training = {"transformers", "peft", "trl", "torch"}
    assert loaded_by_importing(entry_point, watched=training) == []
