"""The documentation says what the code does: every setting is in the operator guide."""

from __future__ import annotations

from pathlib import Path

from skytrain_backend.config import variables

REPO = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_operator_guides_configuration_tables() -> None:
    guide = (REPO / "docs" / "operators.md").read_text()
    tables = guide[guide.index("## Configuration") :].split("\n## ")[0]
    # A setting read under another library's own name (PROMETHEUS_MULTIPROC_DIR) is
    # documented under that name.
    missing = [name for name in variables() if f"`{name}`" not in tables]
    assert not missing, f"settings missing from docs/operators.md: {missing}"
