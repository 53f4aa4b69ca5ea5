"""Trainer test fixtures: the tiny model loaded as a Trainer, its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.protocol import ModelConfig
from skytrain_backend.trainer import Trainer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def tiny_trainer(tiny_model_path: Path) -> Trainer:
    """A fresh adapter on the tiny model, on CPU."""
    return Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_path: Path) -> Any:
    """The tiny model without an adapter, in fp32 on CPU: the "engine" tests sample from."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
