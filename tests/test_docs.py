"""The documentation says what the code does: every setting is in the operator guide."""

from __future__ import annotations

from pathlib import Path

from skytrain_backend.config import Settings

REPO = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_operator_guides_configuration_tables() -> None:
    guide = (REPO / "docs" / "operators.md").read_text()
    tables = guide[guide.index("## Configuration") :].split("\n## ")[0]
    missing = [
        f"SKYTRAIN_{name.upper()}"
        for name in Settings.model_fields
        if f"`SKYTRAIN_{name.upper()}`" not in tables
    ]
    assert not missing, f"settings missing from docs/operators.md: {missing}"
