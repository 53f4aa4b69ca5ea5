"""The trainer's shape (issue 37): one ``Trainer`` class, the RL and SFT steps functions over it.

Read from the source with ``ast``: no class in ``trainer/`` has more than one base from the
project (mixins), and no module there imports another module's private names.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import skytrain_backend
import skytrain_backend.trainer

BACKEND = Path(skytrain_backend.__file__).parent
TRAINER = Path(skytrain_backend.trainer.__file__).parent


def _trees(folder: Path) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(folder.rglob("*.py"))}


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):  # Generic[T] and the like
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


def _classes(folder: Path) -> frozenset[str]:
    return frozenset(
        node.name
        for tree in _trees(folder).values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    )


_backend_classes = functools.cache(lambda: _classes(BACKEND))


def project_mixins(folder: Path) -> list[str]:
    """Classes under ``folder`` with more than one base that is a class of the project (of
    ``backend/``, or of ``folder`` itself)."""
    project_classes = _backend_classes() | _classes(folder)
    found = []
    for path, tree in _trees(folder).items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [_base_name(base) for base in node.bases]
            ours = [name for name in bases if name in project_classes]
            if len(ours) > 1:
                found.append(f"{path.name}: class {node.name}({', '.join(ours)})")
    return found


def private_imports(folder: Path) -> list[str]:
    """``from module import _name`` under ``folder``: another module's private names."""
    return [
        f"{path.name}: from {node.module} import {alias.name}"
        for path, tree in _trees(folder).items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_trainer_class_has_more_than_one_base_from_the_project():
    assert project_mixins(TRAINER) == []


def test_the_check_finds_a_mixin(tmp_path):
    (tmp_path / "mixed.py").write_text(
        "from skytrain_backend.trainer.trainer import Trainer\n"
        "from skytrain_backend.trainer.plans import RLPlan\n"
        "class Mixed(Trainer, RLPlan):\n    pass\n"
    )
    assert project_mixins(tmp_path) == ["mixed.py: class Mixed(Trainer, RLPlan)"]


def test_no_trainer_module_imports_another_modules_private_names():
    assert private_imports(TRAINER) == []
