"""Shared test setup. Fixtures live in tests/fixtures/, one module per kind of real part."""

from __future__ import annotations

import importlib.util

import pytest

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.services",
]


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
