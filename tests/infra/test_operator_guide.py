"""docs/operators.md: the commands it gives are the ones that work.

Every `skytrain` command in the guide's shell blocks is a real command with real options; the
"First steps" block runs as written against PostgreSQL; the variables it names are settings.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import variables

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operators.md"
SKYTRAIN = str(Path(sys.executable).parent / "skytrain")
# Variables the guide names that are not server settings: the SDK's, sky/*.yaml's install spec.
# The SDK's variables, and the rendezvous port every node of a multi-node worker reads from
# its environment (worker.sharded.Rendezvous: followers run without the control plane's
# settings).
NOT_SETTINGS = {"SKYTRAIN_API_KEY", "SKYTRAIN_BASE_URL", "SKYTRAIN_TRAINER_MASTER_PORT"}


def _shell_blocks(section: str | None = None) -> list[str]:
    text = GUIDE.read_text()
    if section is not None:
        text = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(block: str) -> list[str]:
    """The block's shell commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def _tokens(command: str) -> list[str]:
    """Words of a command, with quoted scripts (ssh '...', sh -c '...') split too."""
    words = []
    for word in shlex.split(command):
        words.extend(_tokens(word) if " " in word else [word])
    return words


def _help(*command: str) -> str | None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    return result.output if result.exit_code == 0 else None


def _skytrain_invocations() -> list[tuple[list[str], list[str]]]:
    """(command words, options) of every `skytrain ...` the guide's shell blocks run."""
    top = {"serve", "keys", "db", "workers", "worker", "jobs", "logs", "engine", "tenants"}
    found = []
    for block in _shell_blocks():
        for command in _commands(block):
            words = _tokens(command)
            for at, word in enumerate(words[:-1]):
                if word != "skytrain" or words[at + 1] not in top:
                    continue
                rest = words[at + 1 :]
                names = []
                for item in rest:
                    if not re.fullmatch(r"[a-z][a-z-]*", item):
                        break
                    names.append(item)
                while names and _help(*names) is None:
                    names.pop()  # a trailing argument, not a subcommand
                options = [item.split("=")[0] for item in rest if item.startswith("--")]
                found.append((names, options))
    return found


def test_guide_runs_skytrain_commands_and_options_that_exist() -> None:
    invocations = _skytrain_invocations()
    named = {" ".join(names) for names, _ in invocations}
    assert {"db upgrade", "keys create", "workers token create", "serve"} <= named
    for names, options in invocations:
        text = _help(*names)
        assert text is not None and names, f"no command `skytrain {' '.join(names)}`"
        for option in options:
            assert option in text, f"`skytrain {' '.join(names)}` has no option {option}"


@pytest.mark.postgres
@pytest.mark.slow
def test_first_steps_run_as_written(tmp_path: Path, make_postgres_url: Callable[[], str]) -> None:
    (block,) = _shell_blocks("First steps")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYTRAIN_")}
    env.update(SKYTRAIN_HOME=str(tmp_path), SKYTRAIN_DATABASE_URL=make_postgres_url())
    outputs: dict[str, str] = {}
    for command in _commands(block):
        words = shlex.split(command)
        assert words[0] == "skytrain"
        if words[1:4] == ["workers", "token", "revoke"]:
            # The guide's placeholder: the prefix `workers token list` showed.
            token = outputs["workers token create"]
            words[4] = token[:10] + "..."
        result = subprocess.run(
            [SKYTRAIN, *words[1:]], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{command}: {result.stderr}"
        outputs[" ".join(w for w in words[1:4] if not w.startswith("-"))] = result.stdout
    assert "up to date" in outputs["db current"]
    assert re.fullmatch(r"sk-st-\S{43}\n", outputs["keys create"])
    token = outputs["workers token create"].strip()
    assert re.fullmatch(r"swj-\S{43}", token)
    assert token[:10] in outputs["workers token list"]
    assert "Qwen/Qwen2.5-7B-Instruct" in outputs["workers token list"]
    assert "Revoked join token" in outputs["workers token revoke"]


def test_variables_in_the_guide_are_settings() -> None:
    text = GUIDE.read_text()
    settings = set(variables())
    named = set(re.findall(r"\bSKYTRAIN_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert not named - settings - NOT_SETTINGS, sorted(named - settings - NOT_SETTINGS)
    table = text.split("## Configuration\n", 1)[1].split("\n## ", 1)[0]
    named_in_table = {("scheduler", "provider"), ("hub", "token"), ("server", "public_url")}
    for variable, (group, field) in variables().items():
        if group == "skypilot" or (group, field) in named_in_table:
            assert f"`{variable}`" in table, f"the table lacks {variable}"


def test_readme_links_the_guide() -> None:
    assert "(docs/operators.md)" in (ROOT / "README.md").read_text()
