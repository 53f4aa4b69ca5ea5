"""Starting engines: the vLLM command line, the engine choice, and waiting on a real process.

The waits run against real short-lived subprocesses: one that serves /health after a delay,
one that dies while "loading", one that never answers.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.config import Settings
from skytrain_backend.engine import options as engine_options
from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import (
    API_KEY_ENV,
    EngineProcess,
    engine_command,
    hf_command,
)
from skytrain_backend.engine.options import EngineCommand, EngineOptions, select_engine
from skytrain_backend.engine.vllm import vllm_command, vllm_platform
from skytrain_backend.errors import ConfigurationError, EngineError
from skytrain_backend.planning import lora_rank_slot
from tests.fixtures.ports import free_port


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_enables_runtime_lora_sleep_mode_and_hermes_tool_calls(tmp_path: Path) -> None:
    options = EngineOptions(
        model=str(tmp_path),
        served_model_name="Qwen/Qwen2.5-7B-Instruct",
        host="127.0.0.1",
        port=8123,
        api_key="secret-1",
        max_model_len=8192,
        max_loras=6,
        max_lora_rank=24,
        gpu_memory_utilization=0.55,
        tensor_parallel_size=2,
    )
    command = vllm_command(options)
    argv = command.argv
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tmp_path)]
    assert _flag(argv, "--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("127.0.0.1", "8123")
    assert "--enable-lora" in argv
    assert _flag(argv, "--max-lora-rank") == "32"  # vLLM accepts only its fixed set of ranks
    assert _flag(argv, "--max-loras") == "6"
    assert "--enable-sleep-mode" in argv
    assert "--enable-auto-tool-choice" in argv
    assert _flag(argv, "--tool-call-parser") == "hermes"
    assert _flag(argv, "--gpu-memory-utilization") == "0.55"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--max-model-len") == "8192"
    assert "secret-1" not in " ".join(argv)  # the key travels in the environment only
    assert command.env == {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_API_KEY": "secret-1",
    }


def test_where_vllm_has_no_sleep_mode_it_is_not_asked_for_and_the_command_says_so(
    tmp_path: Path,
) -> None:
    """vLLM's CPU build refuses --enable-sleep-mode; its sleep routes answer but free nothing."""
    command = vllm_command(EngineOptions(model=str(tmp_path)), sleep_mode=False)
    assert "--enable-sleep-mode" not in command.argv
    assert "--enable-auto-tool-choice" in command.argv
    assert not command.sleep_frees_memory
    assert vllm_command(EngineOptions(model=str(tmp_path))).sleep_frees_memory


def test_vllm_runs_from_the_interpreter_the_settings_name(tmp_path: Path) -> None:
    settings = Settings(engine={"vllm_python": "/opt/vllm-env/bin/python"})
    options = EngineOptions.from_settings(settings, model=str(tmp_path), port=1)
    assert vllm_command(options).argv[:3] == [
        "/opt/vllm-env/bin/python",
        "-m",
        "vllm.entrypoints.cli.main",
    ]
    assert select_engine("vllm", vllm_python="/opt/vllm-env/bin/python") == "vllm"
    assert select_engine("hf", vllm_python="/opt/vllm-env/bin/python") == "hf"


def test_an_interpreter_without_vllm_fails_the_platform_check_saying_why() -> None:
    with pytest.raises(ConfigurationError, match=r"vLLM does not load in .*No module named"):
        vllm_platform(sys.executable)
    with pytest.raises(ConfigurationError, match="could not run vLLM's interpreter"):
        vllm_platform("/nonexistent/bin/python")


def test_vllm_listens_on_loopback_only(tmp_path: Path) -> None:
    """Its dev-mode routes (sleep, collective_rpc, weight updates) take no key: never exposed."""
    with pytest.raises(ConfigurationError, match=r"listens on 127\.0\.0\.1 only"):
        vllm_command(EngineOptions(model=str(tmp_path), host="0.0.0.0"))


def test_vllm_command_serves_the_model_under_its_given_name_by_default(tmp_path: Path) -> None:
    argv = vllm_command(EngineOptions(model=str(tmp_path))).argv
    assert _flag(argv, "--served-model-name") == str(tmp_path)
    assert "--max-model-len" not in argv
    assert "VLLM_API_KEY" not in vllm_command(EngineOptions(model=str(tmp_path))).env


def test_lora_rank_rounds_up_to_a_rank_vllm_accepts() -> None:
    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ConfigurationError, match="above vLLM's largest"):
        lora_rank_slot(1024)


def test_hf_command_runs_skytrain_engine_serve_with_the_key_in_the_environment() -> None:
    options = EngineOptions(model="m", port=9001, api_key="k", max_model_len=256, threads=2)
    command = hf_command(options)
    assert command.argv[:4] == [sys.executable, "-m", "skytrain_backend.engine", "serve"]
    assert _flag(command.argv, "--engine") == "hf"
    assert _flag(command.argv, "--served-model-name") == "m"
    assert (_flag(command.argv, "--max-model-len"), _flag(command.argv, "--threads")) == (
        "256",
        "2",
    )
    assert command.env == {API_KEY_ENV: "k"}
    assert engine_command(options, "hf") == command


def test_engine_options_take_the_engine_settings() -> None:
    settings = Settings(
        engine={
            "max_loras": 7,
            "max_lora_rank": 16,
            "gpu_memory_utilization": 0.5,
            "tensor_parallel_size": 4,
            "max_model_len": 2048,
        }
    )
    options = EngineOptions.from_settings(settings, model="m", port=1, served_model_name=None)
    assert (options.max_loras, options.max_lora_rank, options.max_model_len) == (7, 16, 2048)
    assert (options.gpu_memory_utilization, options.tensor_parallel_size) == (0.5, 4)
    assert options.name == "m"
    overridden = EngineOptions.from_settings(settings, model="m", port=1, max_model_len=64)
    assert overridden.max_model_len == 64


def test_engine_choice_auto_needs_both_cuda_and_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    has_vllm = engine_options.importlib.util.find_spec("vllm") is not None
    assert select_engine("hf") == "hf"
    expected_auto = "vllm" if has_vllm and engine_options.cuda_available() else "hf"
    assert select_engine("auto") == expected_auto
    if not has_vllm:
        with pytest.raises(ConfigurationError, match="vllm is not installed"):
            select_engine("vllm")
    with pytest.raises(ConfigurationError, match="use auto, vllm or hf"):
        select_engine("tgi")


def _scripted_engine(
    tmp_path: Path, source: str, *, port: int | None = None, **options: Any
) -> EngineProcess:
    """An engine process that runs the Python ``source`` in place of an engine, on ``port``
    (a free one if None), logging to ``tmp_path / "engine.log"``."""
    script = tmp_path / "fake_engine.py"
    script.write_text(textwrap.dedent(source))
    return EngineProcess(
        EngineCommand(argv=[sys.executable, str(script)]),
        base_url=f"http://127.0.0.1:{port or free_port()}",
        log_path=tmp_path / "engine.log",
        **options,
    )


async def test_waiting_returns_once_the_process_serves_health(tmp_path: Path) -> None:
    port = free_port()
    process = _scripted_engine(
        tmp_path,
        f"""
        import http.server, time
        print("loading weights...", flush=True)
        time.sleep(1.0)
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
        http.server.HTTPServer(("127.0.0.1", {port}), Health).serve_forever()
        """,
        port=port,
    )
    process.start()
    try:
        await process.wait_until_healthy(timeout_s=60)
        assert process.is_alive()
        assert "loading weights..." in process.log_tail()
    finally:
        process.stop()
    assert not process.is_alive()
    assert process.poll() is not None


async def test_an_engine_that_dies_fails_the_wait_at_once_with_its_last_log_lines(
    tmp_path: Path,
) -> None:
    process = _scripted_engine(
        tmp_path,
        """
        import sys
        print("loading model", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", flush=True)
        sys.exit(3)
        """,
    )
    process.start()
    with pytest.raises(EngineError) as raised:
        # A whole hour of patience, yet the wait ends as soon as the process does.
        await process.wait_until_healthy(timeout_s=3600)
    message = str(raised.value)
    assert "exited with code 3" in message
    assert "CUDA out of memory" in message


async def test_an_engine_that_never_answers_fails_at_the_timeout_and_launch_stops_it(
    tmp_path: Path,
) -> None:
    process = _scripted_engine(
        tmp_path,
        """
        import time
        print("stuck compiling kernels", flush=True)
        time.sleep(600)
        """,
        startup_timeout_s=2,
    )
    with pytest.raises(EngineError, match="did not become healthy within 2s") as raised:
        await process.launch()
    assert "stuck compiling kernels" in str(raised.value)
    assert process.pid is not None
    assert not process.is_alive()  # a launch that fails leaves no process behind


def test_for_engine_builds_the_command_of_the_chosen_engine(tmp_path: Path) -> None:
    options = EngineOptions(model=str(tmp_path), port=9002, api_key="k")
    process = EngineProcess.for_engine(options, kind="hf", log_path=tmp_path / "log")
    assert process.command == hf_command(options)
    assert (process.base_url, process.api_key) == ("http://127.0.0.1:9002", "k")
    # vLLM's command depends on its platform, asked first: one that does not load starts
    # nothing (the real vLLM's command: tests/engine/test_vllm_cpu.py, `-m vllm`).
    without_vllm = EngineOptions(model=str(tmp_path), vllm_python=sys.executable)
    with pytest.raises(ConfigurationError, match="vLLM does not load"):
        EngineProcess.for_engine(without_vllm, kind="vllm", log_path=tmp_path / "log")
    assert not (tmp_path / "log").exists()


@pytest.mark.slow
async def test_for_engine_starts_a_working_cpu_engine(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """The command the worker runs (`python -m skytrain_backend.engine serve`), end to end."""
    options = EngineOptions(
        model=str(tiny_model_path),
        served_model_name="launched",
        port=free_port(),
        api_key="launch-key",
        max_model_len=128,
        threads=1,
    )
    process = EngineProcess.for_engine(
        options, kind="hf", log_path=tmp_path / "engine.log", startup_timeout_s=300
    )
    await process.launch()
    try:
        async with EngineClient(options.base_url, api_key="launch-key") as client:
            assert await client.models() == ["launched"]
        async with EngineClient(options.base_url) as keyless:
            with pytest.raises(EngineError, match="401"):
                await keyless.models()
    finally:
        process.stop()
    assert not process.is_alive()


def test_a_model_split_across_nodes_runs_pipeline_stages_over_ray(tmp_path: Path) -> None:
    """vLLM's documented multi-node layout: tensor parallelism within a node, pipeline
    stages across nodes, on a Ray cluster; one node asks for neither."""
    settings = Settings(storage={"home": tmp_path}, engine={"pipeline_parallel_size": 2})
    options = EngineOptions.from_settings(settings, model="m", port=8000, tensor_parallel_size=8)
    argv = vllm_command(options).argv
    assert _flag(argv, "--tensor-parallel-size") == "8"
    assert _flag(argv, "--pipeline-parallel-size") == "2"
    assert _flag(argv, "--distributed-executor-backend") == "ray"
    single = vllm_command(EngineOptions(model="m", tensor_parallel_size=8)).argv
    assert "--pipeline-parallel-size" not in single
    assert "--distributed-executor-backend" not in single
