"""One name per thing in ``backend/``: no two classes share a name, and no module name is
used in more than three places (``routes/models.py`` beside ``db/models.py`` is fine; six
``tinker.py`` files were not). Private classes (``_Params``) are their module's own. In the
SDK, one module makes the HTTP calls: the ``Backend`` (``_backend.py``); models ask it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import skytrain
import skytrain_backend

BACKEND = Path(skytrain_backend.__file__).parent
SDK = Path(skytrain.__file__).parent
MAX_PLACES_PER_MODULE_NAME = 3


def _modules() -> list[Path]:
    return sorted(BACKEND.rglob("*.py"))


def _where(path: Path) -> str:
    return path.relative_to(BACKEND).as_posix()


def test_no_two_classes_in_the_backend_share_a_name() -> None:
    places: defaultdict[str, list[str]] = defaultdict(list)
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                places[node.name].append(_where(path))
    shared = {name: where for name, where in places.items() if len(where) > 1}
    assert not shared, f"class names defined more than once: {shared}"


def test_no_module_name_is_used_in_more_than_three_places() -> None:
    places: defaultdict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name not in ("__init__.py", "__main__.py"):
            places[path.name].append(_where(path))
    crowded = {
        name: where for name, where in places.items() if len(where) > MAX_PLACES_PER_MODULE_NAME
    }
    assert not crowded, f"module names used in more than three places: {crowded}"


def test_the_sdks_http_paths_are_all_in_its_backend() -> None:
    places: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(SDK.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            path_like = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if path_like and node.value.startswith(("/v1", "/api/")):
                places[path.name].append(node.value)
    assert set(places) == {"_backend.py"}, f"HTTP paths outside the SDK's backend: {places}"
