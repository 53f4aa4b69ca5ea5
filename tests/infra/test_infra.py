"""infra/: the compose file and the Dockerfiles, checked by the validators that run here.

There is no Docker engine on the test machine. The compose file goes through the Compose
Specification parser (``compose-spec``, after YAML anchors and merge keys are applied as
Compose applies them) and through the references Compose itself would check; the Dockerfiles
through hadolint. What the files promise skytrain (commands, flags, settings, ports) is checked
against the real CLI and settings.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import ServerSettings, variables

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
DOCKERFILES = [INFRA / "Dockerfile.control-plane", INFRA / "Dockerfile.worker"]
HADOLINT = str(Path(sys.executable).parent / "hadolint")
INTERPOLATION = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(:?[-?])?([^}]*)\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as Compose sees it: anchors and merge keys applied, then parsed."""
    document = yaml.safe_load(COMPOSE.read_text())
    parsed = PyCompose.from_json(json.dumps(document))
    parsed.to_spec()  # and validated against the specification's model
    return dict(parsed.to_dict())


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, f"skytrain has no command {' '.join(command)}"
    return result.output


def _env_example() -> dict[str, str]:
    pairs = {}
    for line in (INFRA / "env.example").read_text().splitlines():
        line = line.removeprefix("# ").strip()
        if re.match(r"^[A-Z_][A-Z0-9_]*=", line):
            name, _, value = line.partition("=")
            pairs[name] = value
    return pairs


# --- compose ------------------------------------------------------------------------------------


def test_compose_defines_the_production_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {
        "postgres",
        "minio",
        "create-bucket",
        "migrate",
        "skytrain",
        "proxy",
        "prometheus",
        "grafana",
    }
    # Metrics are opt-in (`--profile metrics`): a plain `up` starts what it always did.
    assert compose["services"]["prometheus"]["profiles"] == ["metrics"]
    assert compose["services"]["grafana"]["profiles"] == ["metrics"]


def test_prometheus_scrapes_the_metrics_listener_never_the_public_port(
    compose: dict[str, Any],
) -> None:
    server = compose["services"]["skytrain"]
    port = server["environment"]["SKYTRAIN_METRICS_PORT"]
    config = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"skytrain:{port}"]
    # The listener is not published on the host; only the public port is.
    assert all(not str(p).endswith(f":{port}") for p in server["ports"])
    sources = [
        volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
        for volume in compose["services"]["prometheus"]["volumes"]
    ]
    assert any(str(source).endswith("prometheus/prometheus.yml") for source in sources)


def test_the_compose_parser_rejects_what_compose_rejects() -> None:
    """The validator is live: a misspelt key and an unknown condition are refused."""
    document = yaml.safe_load(COMPOSE.read_text())
    document["services"]["skytrain"]["depends_onn"] = document["services"]["skytrain"].pop(
        "depends_on"
    )
    with pytest.raises(ValueError, match="depends_onn"):
        PyCompose.from_json(json.dumps(document))
    document = yaml.safe_load(COMPOSE.read_text())
    document["services"]["migrate"]["depends_on"]["postgres"]["condition"] = "service_happy"
    with pytest.raises(ValueError, match="service_happy"):
        PyCompose.from_json(json.dumps(document))


def test_compose_references_resolve(compose: dict[str, Any]) -> None:
    services = compose["services"]
    declared_volumes = set(compose.get("volumes", {}))
    built_images = {s["image"] for s in services.values() if "build" in s}
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared_volumes, f"{name} mounts undeclared volume {source}"
        if "build" in service:
            build = service["build"]
            context = (COMPOSE.parent / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file()
        else:
            image = service["image"]
            pinned = ":" in image and not image.endswith(":latest")
            assert image in built_images or pinned, f"{name} runs an unpinned image {image}"


def test_server_starts_after_the_schema_upgrade_and_the_bucket(compose: dict[str, Any]) -> None:
    services = compose["services"]
    waits = services["skytrain"]["depends_on"]
    assert waits["migrate"]["condition"] == "service_completed_successfully"
    assert waits["create-bucket"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # The image's entrypoint is `skytrain`: migrate runs `skytrain db upgrade`, the server
    # `skytrain serve`, both real commands.
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["skytrain"]["command"] == ["serve"]
    _help("db", "upgrade")
    _help("serve")


def test_server_settings_point_at_the_services_beside_it(compose: dict[str, Any]) -> None:
    services = compose["services"]
    env = services["skytrain"]["environment"]
    unknown = {name for name in env if name.startswith("SKYTRAIN_")} - set(variables())
    assert not unknown, f"no setting reads {sorted(unknown)}"
    postgres = services["postgres"]["environment"]
    assert env["SKYTRAIN_DATABASE_URL"].startswith(
        f"postgresql+psycopg://{postgres['POSTGRES_USER']}:"
    )
    assert env["SKYTRAIN_DATABASE_URL"].endswith(f"@postgres:5432/{postgres['POSTGRES_DB']}")
    bucket = env["SKYTRAIN_OBJECT_STORE_URL"].removeprefix("s3://").split("/")[0]
    assert f"store/{bucket}" in " ".join(services["create-bucket"]["entrypoint"])
    assert "http://minio:9000" in env["SKYTRAIN_S3_ENDPOINT_URL"]
    assert env["SKYTRAIN_AUTO_MIGRATE"] == "false"  # the migrate service owns upgrades
    assert (
        services["migrate"]["environment"]["SKYTRAIN_DATABASE_URL"]
        == (env["SKYTRAIN_DATABASE_URL"])
    )
    (published,) = services["skytrain"]["ports"]
    assert str(published).rpartition(":")[2] == str(ServerSettings.model_fields["port"].default)


def test_env_example_sets_what_compose_requires() -> None:
    example = _env_example()
    text = COMPOSE.read_text()
    for name, operator, _ in INTERPOLATION.findall(text):
        assert name in example, f"infra/env.example does not mention {name}"
        if operator == ":?":
            assert example[name], f"infra/env.example leaves required {name} empty"


# --- Dockerfiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run(
        [HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged base image


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [
        (line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1])
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_pass_the_dockerignore(dockerfile: Path) -> None:
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for instruction, arguments in _instructions(dockerfile):
        if instruction != "COPY":
            continue
        *sources, _ = shlex.split(arguments)
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"
            assert source.rstrip("/") in allowed, f"{source} is excluded from the build context"


def test_control_plane_image_installs_the_server_without_torch() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    runs = [a for i, a in _instructions(DOCKERFILES[0]) if i == "RUN" and "pip install" in a]
    (install,) = runs
    extras = re.search(r"\[([a-z,]+)\]", install)
    assert extras is not None
    assert set(extras.group(1).split(",")) == {"server", "skypilot"}
    for extra in extras.group(1).split(","):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"no extra {extra!r}"
    entrypoint = dict(_instructions(DOCKERFILES[0]))["ENTRYPOINT"]
    assert json.loads(entrypoint) == ["skytrain"]
    assert "EXPOSE 8000" in DOCKERFILES[0].read_text()


def test_worker_image_is_vllm_with_a_worker_entrypoint() -> None:
    instructions = _instructions(DOCKERFILES[1])
    image = next(a for i, a in instructions if i == "ARG" and a.startswith("VLLM_IMAGE="))
    assert re.fullmatch(r"VLLM_IMAGE=vllm/vllm-openai:v\d+\.\d+\.\d+", image)
    # The same vLLM as the SkyPilot worker task.
    sky_image = yaml.safe_load((ROOT / "sky" / "worker.yaml").read_text())["resources"]["image_id"]
    assert sky_image == "docker:" + image.removeprefix("VLLM_IMAGE=")
    entrypoint = json.loads(dict(instructions)["ENTRYPOINT"])
    assert entrypoint[:2] == ["skytrain", "worker"]
    options = _help("worker")
    for flag in (word for word in entrypoint if word.startswith("--")):
        assert flag in options, f"`skytrain worker` has no option {flag}"
    port = entrypoint[entrypoint.index("--port") + 1]
    assert f"EXPOSE {port}" in DOCKERFILES[1].read_text()
