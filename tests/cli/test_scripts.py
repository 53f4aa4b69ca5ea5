"""The scripts a newcomer runs first: ``scripts/demo.sh`` sets up only what the demo needs,
``scripts/test.sh`` the test stack too (issue 36: the demo installed chromium and prometheus
system-wide and failed on another apt's lock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELLCHECK = str(Path(sys.executable).parent / "shellcheck")


@pytest.mark.parametrize("name", ["setup.sh", "demo.sh", "test.sh"])
def test_the_scripts_pass_shellcheck(name: str) -> None:
    result = subprocess.run(
        [SHELLCHECK, str(ROOT / "scripts" / name)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_setup_refuses_an_unknown_argument_before_installing_anything(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = subprocess.run(
        [str(ROOT / "scripts" / "setup.sh"), "--tests"],
        env={"PATH": "/usr/bin:/bin", "SKYTRAIN_VENV": str(venv)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "unknown argument '--tests'" in result.stderr and "[--test]" in result.stderr
    assert not venv.exists()


def test_only_the_test_script_asks_for_the_test_stack() -> None:
    """The demo runs setup.sh bare; the test suite (and CI through it) with --test."""
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    tests = (ROOT / "scripts" / "test.sh").read_text()
    assert "./scripts/setup.sh\n" in demo and "setup.sh --test" not in demo
    assert "./scripts/setup.sh --test\n" in tests
