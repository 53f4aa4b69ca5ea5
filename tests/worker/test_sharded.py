"""The sharded trainer's launch (worker.sharded): torchrun's rendezvous on one node and from
SkyPilot's multi-node environment, and a failed run's error. The runs that train are in
tests/trainer/test_distributed.py."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from skytrain_backend.errors import ConfigurationError, TrainingError
from skytrain_backend.protocol import ModelConfig, SFTTrainConfig, Trajectory
from skytrain_backend.worker.sharded import Rendezvous, ShardedTrainer, torchrun_command
from tests.trainer.test_resume import _answers


def test_one_node_meets_at_a_local_rendezvous() -> None:
    rendezvous = Rendezvous.from_skypilot({}, gpus_per_node=8)
    assert rendezvous.world_size == 8
    command = torchrun_command(Path("job.json"), rendezvous)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=8" in command and "--standalone" in command
    assert command[-3:] == ["-m", "skytrain_backend.trainer.job", "job.json"]
    # A single-node SkyPilot task lists one address: still local.
    assert Rendezvous.from_skypilot({"SKYPILOT_NODE_IPS": "10.0.0.5\n"}, gpus_per_node=2).nodes == 1


def test_several_nodes_meet_at_the_head_node_skypilot_names_first() -> None:
    env = {
        "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7\n",
        "SKYPILOT_NODE_RANK": "2",
        "SKYTRAIN_TRAINER_MASTER_PORT": "29600",
    }
    rendezvous = Rendezvous.from_skypilot(env, gpus_per_node=8)
    assert rendezvous.world_size == 24
    assert rendezvous.torchrun_args() == [
        "--nproc-per-node=8",
        "--nnodes=3",
        "--node-rank=2",
        "--master-addr=10.0.0.5",
        "--master-port=29600",
    ]


@pytest.mark.parametrize("rank", [None, "3", "head"])
def test_several_nodes_without_a_usable_node_rank_are_refused(rank: str | None) -> None:
    env = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6"}
    if rank is not None:
        env["SKYPILOT_NODE_RANK"] = rank
    with pytest.raises(ConfigurationError, match="needs this node's rank"):
        Rendezvous.from_skypilot(env, gpus_per_node=8)


@pytest.mark.slow
def _on_one_cpu(
    base_model: Path, tmp_path: Path, model_config: ModelConfig, **more: Any
) -> ShardedTrainer:
    """A sharded trainer of one CPU process, its runs under ``tmp_path / "runs"``; ``more``
    are ShardedTrainer's other options (``env``, ``exit_grace_s``)."""
    return ShardedTrainer(
        str(base_model),
        model_config=model_config,
        adapter_dir=None,
        rendezvous=Rendezvous(gpus_per_node=1),
        work_dir=tmp_path / "runs",
        device="cpu",
        **more,
    )


def test_a_failed_run_is_a_training_error_without_this_machines_paths(tmp_path: Path) -> None:
    """A batch the ranks cannot read fails them before any model loads."""
    trainer = _on_one_cpu(tmp_path / "model", tmp_path, ModelConfig())
    bad = Trajectory.model_construct(messages_and_choices=[], reward=0.0)  # needs a message
    plan = trainer.prepare_sft([bad], SFTTrainConfig())
    with pytest.raises(TrainingError, match=r"1 processes\) failed with exit code") as raised:
        next(trainer.run(plan))
    assert str(tmp_path) not in raised.value.message
    # What the ranks were given, on this worker's disk.
    spec = json.loads((tmp_path / "runs" / "run-1" / "job.json").read_text())
    assert spec["kind"] == "sft" and spec["control_dir"].endswith("control")
    assert "Error" in (tmp_path / "runs" / "run-1" / "output.log").read_text()


# Every Python process that imports it (torchrun's agent and its ranks) sleeps at exit: a
# teardown that never ends, injected into the real processes.
HANG_AT_EXIT = "import atexit, time\natexit.register(time.sleep, 3600)\n"


@pytest.mark.slow
def test_ranks_hung_after_their_last_word_are_stopped_and_the_job_keeps_its_output(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A real one-process SFT job whose processes hang at exit once rank 0 said it saved:
    the worker stops them after the grace (the port they hold is the next job's) and the
    checkpoint they wrote is the job's."""
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text(HANG_AT_EXIT)
    trainer = _on_one_cpu(
        tiny_model_path,
        tmp_path,
        ModelConfig(max_seq_length=64),
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(hang), os.environ.get("PYTHONPATH")])),
        },
        exit_grace_s=1.0,
    )
    plan = trainer.prepare_sft(_answers(2), SFTTrainConfig(batch_size=2, seed=1))
    metrics = list(trainer.run(plan))
    assert len(metrics) == plan.num_gradient_steps == 1 and plan.finished
    # torchrun's agent and its ranks (each in a session of its own) are all gone.
    assert trainer._process is not None and trainer._process.poll() is not None
    assert not [p for p in psutil.process_iter(["cmdline"]) if _runs_in(p, tmp_path)]
    trainer.save(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "adapter_model.safetensors").is_file()
    assert trainer.step == 1


@pytest.mark.slow
def test_ranks_die_with_their_torchrun(tiny_model_path: Path, tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: a worker killed (its torchrun
    killed with it) must not leave the ranks waiting between two steps for ever."""
    trainer = _on_one_cpu(
        tiny_model_path,
        tmp_path,
        ModelConfig(max_seq_length=64),
        env={"OMP_NUM_THREADS": "1"},
    )
    plan = trainer.prepare_sft(_answers(2), SFTTrainConfig(batch_size=1, seed=1))
    next(trainer.run(plan))  # the ranks now wait for the word to take step 2
    assert trainer._process is not None
    ranks = psutil.Process(trainer._process.pid).children(recursive=True)
    assert ranks
    os.kill(trainer._process.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(ranks, timeout=60)
    for rank in alive:  # a failed run's leftovers
        rank.kill()
    assert alive == []


def _runs_in(process: psutil.Process, directory: Path) -> bool:
    """Whether ``process`` was started on a job under ``directory``."""
    return any(str(directory) in part for part in process.info["cmdline"] or [])
