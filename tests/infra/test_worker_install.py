"""`skytrain[worker,gpu]` installs into the vLLM image: pip's resolver says so; and where
Unsloth can be installed (not there; in an environment of its own).

The worker runs in vllm/vllm-openai:v0.34.0 (Python 3.12, glibc 2.35) and installs skytrain's
wheel there with the image's packages as constraints (sky/worker.yaml, infra/Dockerfile.worker).
This test asks pip to resolve that, for the image's interpreter and platform, with vLLM 0.34.0's
published requirements (its wheel's metadata, which pip reads without the wheel) standing in
for the image: vLLM's ranges, every `==` of vLLM's, and the image's transformers, 5.22.0.
Needs the package index; a minute or two.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
VLLM = "vllm==0.34.0"
# The image's transformers (what vLLM 0.34's image locks), above Unsloth's cap.
IMAGE_TRANSFORMERS = "5.22.0"
# The image's interpreter and platform: Python 3.12 on Ubuntu 22.04 (glibc 2.35), x86_64.
IMAGE_ENVIRONMENT = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
RESOLVE_TIMEOUT_S = 900
# The newest Unsloth, as scripts/unsloth-constraints.txt pins it.
NEWEST_UNSLOTH = "2026.10.9"


def _extra_requirements(*extras: str) -> list[str]:
    """The requirements `skytrain[extras]` installs, as pyproject.toml lists them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    found: list[str] = list(project["dependencies"])
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            inner = re.fullmatch(r"skytrain\[(.+)\]", text)
            if inner:
                pending += [name.strip() for name in inner.group(1).split(",")]
            else:
                found.append(text)
    return found


def _pip_dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    """pip's resolution for the image's interpreter and platform (nothing is installed)."""
    platforms = [word for platform in PLATFORMS for word in ("--platform", platform)]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            *platforms,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=RESOLVE_TIMEOUT_S,
    )


def _resolve(tmp_path: Path, *args: str) -> dict[str, Any]:
    """pip's report of what it would install (its error, when it finds nothing)."""
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    result = _pip_dry_run("--report", str(report), *args)
    said = "\n".join(line for line in result.stderr.splitlines() if "WARNING" not in line)
    assert result.returncode == 0, said[-4000:]
    return dict(json.loads(report.read_text()))


def _vllm_constraints(tmp_path: Path, **image_pins: str) -> dict[str, str]:
    """Writes constraints.txt: vLLM 0.34.0's published ranges and every `==` of its, with
    ``image_pins`` beside them (the image's own versions); returns the `==` pins."""
    (vllm,) = _resolve(tmp_path, "--no-deps", VLLM)["install"]
    vllm_requires = vllm["metadata"]["requires_dist"]
    image = {
        Requirement(text).name: str(next(iter(Requirement(text).specifier))).removeprefix("==")
        for text in vllm_requires
        if re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][^,;]*", text)
    }
    image.update(vllm="0.34.0", **image_pins)
    constraints = [f"{name}=={version}" for name, version in sorted(image.items())]
    for text in vllm_requires:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or marker.evaluate({**IMAGE_ENVIRONMENT, "extra": ""}):
            constraints.append(f"{requirement.name}{requirement.specifier}")
    (tmp_path / "constraints.txt").write_text("\n".join(constraints) + "\n")
    return image


def test_the_worker_and_gpu_extras_resolve_with_vllm_0_34s_requirements(tmp_path: Path) -> None:
    image = _vllm_constraints(tmp_path, transformers=IMAGE_TRANSFORMERS)
    (tmp_path / "requirements.txt").write_text(
        "\n".join(_extra_requirements("worker", "gpu")) + "\n"
    )

    resolved = _resolve(
        tmp_path,
        "--constraint",
        str(tmp_path / "constraints.txt"),
        "--requirement",
        str(tmp_path / "requirements.txt"),
    )
    versions = {
        item["metadata"]["name"].lower().replace("_", "-"): Version(item["metadata"]["version"])
        for item in resolved["install"]
    }
    # The image's vLLM, torch and transformers are kept; the worker's packages fit around them.
    assert versions["transformers"] == Version(IMAGE_TRANSFORMERS)
    assert versions["torch"] == Version(image["torch"])
    assert versions["peft"] in SpecifierSet(">=0.13")
    assert "unsloth" not in versions


def test_the_newest_unsloth_does_not_resolve_beside_vllm_0_34(tmp_path: Path) -> None:
    """Unsloth 2026.10.9 (the newest) with the worker's extra, within vLLM 0.34.0's ranges
    (its transformers range, not the image's one version): pip finds no set. It caps
    transformers at 5.17.0, and transformers 5.16-5.17 cap huggingface-hub below the 2.0
    vLLM needs. (Left free, pip's answer beside vLLM is 2025.9.5, the last release whose
    metadata left transformers unbounded, made for transformers 4.x: docs/operators.md.)"""
    _vllm_constraints(tmp_path)
    (tmp_path / "requirements.txt").write_text(
        "\n".join([*_extra_requirements("worker"), f"unsloth=={NEWEST_UNSLOTH}"]) + "\n"
    )
    result = _pip_dry_run(
        "--constraint",
        str(tmp_path / "constraints.txt"),
        "--requirement",
        str(tmp_path / "requirements.txt"),
    )
    said = " ".join(line for line in result.stderr.splitlines() if "WARNING" not in line)
    assert result.returncode != 0, "Unsloth resolved beside vLLM 0.34: install it on workers"
    assert "ResolutionImpossible" in said or "conflicting dependencies" in said, said[-4000:]


def test_unsloth_resolves_in_a_trainer_environment_of_its_own(tmp_path: Path) -> None:
    """The worker's extra with Unsloth, alone on the image's Python, resolves to the pins of
    scripts/unsloth-constraints.txt: transformers 5.17.0 and a huggingface-hub below 2.0,
    which is why it cannot be vLLM 0.34's environment."""
    pins = ROOT / "scripts" / "unsloth-constraints.txt"
    (tmp_path / "requirements.txt").write_text(
        "\n".join([*_extra_requirements("worker"), "unsloth"]) + "\n"
    )
    resolved = _resolve(
        tmp_path, "--constraint", str(pins), "--requirement", str(tmp_path / "requirements.txt")
    )
    versions = {
        item["metadata"]["name"].lower().replace("_", "-"): Version(item["metadata"]["version"])
        for item in resolved["install"]
    }
    assert versions["unsloth"] == Version(NEWEST_UNSLOTH)
    assert versions["transformers"] == Version("5.17.0")
    assert versions["huggingface-hub"] < Version("2.0")
    assert versions["torch"] in SpecifierSet(">=2.4,<2.15")


def test_the_worker_task_builds_the_unsloth_environment_of_the_pins() -> None:
    """sky/worker.yaml's setup installs the Unsloth that scripts/unsloth-constraints.txt
    resolved, into the venv the worker looks for (worker.trainer_python)."""
    import yaml

    from skytrain_backend.worker.trainer_python import DEFAULT_UNSLOTH_PYTHON

    task = yaml.safe_load((ROOT / "sky" / "worker.yaml").read_text())
    assert str(task["envs"]["WORKER_UNSLOTH_VERSION"]) == NEWEST_UNSLOTH
    pins = (ROOT / "scripts" / "unsloth-constraints.txt").read_text()
    assert f"unsloth=={NEWEST_UNSLOTH}" in pins
    venv = DEFAULT_UNSLOTH_PYTHON.parents[1].name
    assert f"~/{venv}/bin/python -m pip install" in task["setup"]
