"""The SDK's public surface: one sorted ``__all__`` that exports everything users need."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import inspect
import pkgutil
import sys

import pytest

import skytrain
from tests.fixtures.imports import loaded_by_importing


def _private_modules() -> list[str]:
    return sorted(
        f"skytrain.{info.name}"
        for info in pkgutil.iter_modules(skytrain.__path__)
        if info.name.startswith("_")
    )


def test_all_is_sorted() -> None:
    assert skytrain.__all__ == sorted(skytrain.__all__)


def test_all_names_resolve_and_are_unique() -> None:
    assert len(set(skytrain.__all__)) == len(skytrain.__all__)
    for name in skytrain.__all__:
        assert hasattr(skytrain, name), name


def _names_defined_in(module_name: str) -> set[str]:
    """Top-level classes, functions and assignments written in the module's own source."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_public_name_of_the_private_modules_is_exported() -> None:
    """A name without a leading underscore in ``skytrain._x`` is public and must be exported.

    Type aliases count too (``Messages``...): they are names users annotate with. Module
    constants (UPPER_CASE) are not API.
    """
    defined = {
        f"{module_name}.{name}"
        for module_name in _private_modules()
        for name in _names_defined_in(module_name)
        if not name.startswith("_") and not name.isupper()
    }
    assert defined, "found no public names at all: the check itself is broken"
    missing = sorted(name for name in defined if name.rsplit(".", 1)[1] not in skytrain.__all__)
    assert missing == []


def test_exception_tree_has_one_root_and_builtin_bases() -> None:
    errors = [
        value
        for value in (getattr(skytrain, name) for name in skytrain.__all__)
        if inspect.isclass(value) and issubclass(value, BaseException)
    ]
    assert all(issubclass(error, skytrain.SkytrainError) for error in errors)
    assert issubclass(skytrain.APITimeoutError, TimeoutError)
    assert issubclass(skytrain.WaitTimeoutError, TimeoutError)
    assert issubclass(skytrain.APIConnectionError, ConnectionError)
    assert issubclass(skytrain.NotFoundError, LookupError)
    assert issubclass(skytrain.InvalidRequestError, ValueError)
    assert issubclass(skytrain.ServiceUnavailableError, skytrain.ServerError)
    for name in ("InvalidRequestError", "ServingFailedError", "TrainingFailedError"):
        assert name in (skytrain.__doc__ or "") + (
            sys.modules["skytrain._exceptions"].__doc__ or ""
        )


@pytest.mark.slow
def test_importing_the_sdk_loads_no_torch_and_no_server_code() -> None:
    heavy = {"torch", "skytrain_backend", "fastapi", "sqlalchemy", "transformers"}
    assert loaded_by_importing("skytrain", watched=heavy) == []


def test_package_is_typed() -> None:
    assert importlib.resources.files("skytrain").joinpath("py.typed").is_file()
