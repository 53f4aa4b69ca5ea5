"""The worker's trainer in the Unsloth environment (worker.trainer_python): chosen only on
CUDA with the trainer on one GPU and an interpreter there; on this CPU host the plain path.
A trainer process started through another interpreter (a venv of its own here, as the
Unsloth one is on a GPU worker) trains a job to the update the in-process trainer makes."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from safetensors.torch import load_file

from skytrain_backend.protocol import ModelConfig, SFTTrainConfig
from skytrain_backend.trainer import Trainer
from skytrain_backend.worker.sharded import ShardedTrainer, sharded_trainer
from skytrain_backend.worker.sizing import cuda_gpus
from skytrain_backend.worker.trainer_python import trainer_python
from tests.trainer.test_distributed import ADAPTER, _assert_same_metrics, _assert_same_to_noise
from tests.trainer.test_resume import _answers
from tests.worker.support import agent_options


def _fake_venv(directory: Path) -> Path:
    python = directory / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    return python


def test_the_unsloth_environment_is_used_only_on_one_cuda_gpu(tmp_path: Path) -> None:
    venv = str(_fake_venv(tmp_path / "unsloth"))
    missing = tmp_path / "none" / "bin" / "python"
    one_gpu = {"cuda": True, "trainer_shards": 1, "device": None, "default": missing}
    assert trainer_python(venv, **one_gpu) == venv  # type: ignore[arg-type]
    # Built by sky/worker.yaml where SKYTRAIN_UNSLOTH_PYTHON is not set.
    assert trainer_python(None, **{**one_gpu, "default": Path(venv)}) == venv  # type: ignore[arg-type]
    assert trainer_python(None, **one_gpu) is None  # type: ignore[arg-type]
    assert trainer_python(str(missing), **one_gpu) is None  # type: ignore[arg-type]
    # No CUDA, a sharded trainer, or a CPU device: the plain trainer, venv or not.
    assert trainer_python(venv, **{**one_gpu, "cuda": False}) is None  # type: ignore[arg-type]
    assert trainer_python(venv, **{**one_gpu, "trainer_shards": 2}) is None  # type: ignore[arg-type]
    assert trainer_python(venv, **{**one_gpu, "device": "cpu"}) is None  # type: ignore[arg-type]
    # This host: without CUDA (the CPU suite) the worker's selection is the plain path.
    cuda = cuda_gpus() is not None
    chosen = trainer_python(venv, cuda=cuda, trainer_shards=1, device=None)
    assert chosen == (venv if cuda else None)


def _venv_of_this_environment(directory: Path) -> Path:
    """A venv of its own whose packages are this environment's (as the Unsloth venv has its
    own): its interpreter."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120
    )
    python = directory / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Its site directory (with the editable install's own .pth) as this one's.
    parent = sysconfig.get_path("purelib")
    (Path(purelib) / "_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return python


@pytest.mark.slow
def test_a_trainer_process_under_another_interpreter_trains_as_in_process(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    python = _venv_of_this_environment(tmp_path / "venv")
    trajectories = _answers(3)
    lora = ModelConfig(max_seq_length=64)
    config = SFTTrainConfig(learning_rate=5e-2, batch_size=3, num_epochs=1, seed=4)
    one = Trainer.load(str(tiny_model_path), model_config=lora, device="cpu")
    expected_metrics = list(one.run(one.prepare_sft(trajectories, config)))
    one.save(tmp_path / "one")
    options = agent_options(
        tiny_model_path, tmp_path / "worker", device="cpu", trainer_python=str(python)
    )
    trainer = sharded_trainer(options, "model-1", lora, None, env={})
    assert isinstance(trainer, ShardedTrainer) and trainer.python == str(python)
    assert trainer.rendezvous.world_size == 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    metrics = list(trainer.run(trainer.prepare_sft(trajectories, config)))
    trainer.save(tmp_path / "two")
    _assert_same_metrics(expected_metrics, metrics)
    expected, got = (load_file(str(tmp_path / d / ADAPTER)) for d in ("one", "two"))
    scale = sum(float((v.double() ** 2).sum()) for k, v in expected.items() if "lora_B" in k)
    _assert_same_to_noise(expected, got, scale=scale**0.5)


@pytest.mark.gpu
def test_a_job_on_this_gpu_trains_in_the_unsloth_environment(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """On a lent GPU (scripts/gpu-check.sh builds the environment and sets
    SKYTRAIN_UNSLOTH_PYTHON): the worker's choice is that interpreter, and a job's trainer
    process there loads the base with Unsloth and trains."""
    named = os.environ.get("SKYTRAIN_UNSLOTH_PYTHON")
    if not named:
        pytest.skip("SKYTRAIN_UNSLOTH_PYTHON is not set: scripts/gpu-check.sh builds it")
    python = trainer_python(named, cuda=cuda_gpus() is not None, trainer_shards=1, device=None)
    assert python == named
    options = agent_options(tiny_model_path, tmp_path / "worker", trainer_python=python)
    trainer = sharded_trainer(options, "model-1", ModelConfig(max_seq_length=64), None, env={})
    config = SFTTrainConfig(learning_rate=5e-2, batch_size=3, num_epochs=1, seed=4)
    metrics = list(trainer.run(trainer.prepare_sft(_answers(3), config)))
    assert metrics and all(m["loss"] > 0 for m in metrics)
    trainer.save(tmp_path / "saved")
    assert (tmp_path / "saved" / ADAPTER).is_file()
    log = (tmp_path / "worker" / "sharded" / "model-1" / "run-1" / "output.log").read_text()
    assert "Unsloth" in log, log[-2000:]
