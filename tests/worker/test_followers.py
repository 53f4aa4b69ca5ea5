"""A worker of several nodes trains on every node (worker.follower, worker.sharded): the head
worker's own sharded trainer and a follower process on a second "node" (this host, its own
SKYPILOT_NODE_RANK and directory, gloo) run two jobs, the second from the first's checkpoint,
and end with the adapter and optimizer state one process ends with. The follower reads none
of the head's files: rank 0 sends it each job's data and checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skytrain_backend.errors import ConfigurationError
from skytrain_backend.protocol import ModelConfig, SFTTrainConfig
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.job import main as job_main
from skytrain_backend.trainer.trainer import OPTIMIZER_STATE
from skytrain_backend.worker.follower import follower_rendezvous, gpus_per_node
from skytrain_backend.worker.options import AgentOptions
from skytrain_backend.worker.sharded import follower_command, sharded_trainer
from tests.fixtures.ports import port_outside_the_ephemeral_range
from tests.trainer.test_distributed import ADAPTER, _assert_same_metrics, _assert_same_to_noise
from tests.trainer.test_resume import _answers
from tests.worker.support import agent_options

TWO_NODES = {"SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n", "SKYPILOT_NUM_GPUS_PER_NODE": "1"}


def _options(model: Path, work_dir: Path, *, shards: int) -> AgentOptions:
    return agent_options(model, work_dir, device="cpu", trainer_shards=shards)


def test_the_head_worker_meets_its_followers_at_the_head_node(tmp_path: Path) -> None:
    head = {**TWO_NODES, "SKYPILOT_NODE_RANK": "0"}
    trainer = sharded_trainer(
        _options(Path("m"), tmp_path, shards=2), "model-1", ModelConfig(), None, env=head
    )
    rendezvous = trainer.rendezvous  # type: ignore[attr-defined]
    assert (rendezvous.nodes, rendezvous.node_rank, rendezvous.gpus_per_node) == (2, 0, 1)
    follower = follower_rendezvous({**TWO_NODES, "SKYPILOT_NODE_RANK": "1"}, gpus=1)
    assert (follower.nodes, follower.node_rank, follower.master_addr) == (2, 1, "127.0.0.1")
    assert follower_command(tmp_path, follower)[-3:] == [
        "skytrain_backend.trainer.job",
        "--follow",
        str(tmp_path),
    ]
    assert gpus_per_node({"SKYPILOT_NUM_GPUS_PER_NODE": "8"}) == 8
    # The head runs the worker; a follower there, or shards the nodes cannot split, are refused.
    with pytest.raises(ConfigurationError, match="runs the worker"):
        follower_rendezvous(head, gpus=1)
    with pytest.raises(ConfigurationError, match="do not split over 2 nodes"):
        sharded_trainer(
            _options(Path("m"), tmp_path, shards=3), "model-1", ModelConfig(), None, env=head
        )
    with pytest.raises(ConfigurationError, match="runs on the head node"):
        sharded_trainer(
            _options(Path("m"), tmp_path, shards=2),
            "model-1",
            ModelConfig(),
            None,
            env={**TWO_NODES, "SKYPILOT_NODE_RANK": "1"},
        )


def test_follow_is_refused_outside_a_group_of_nodes(tmp_path: Path) -> None:
    assert job_main(["--follow", str(tmp_path)]) == 2
    assert job_main(["--follow"]) == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_two_jobs_on_two_worker_nodes_update_as_one_process(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    trajectories = _answers(4)
    lora = ModelConfig(max_seq_length=64)
    configs = [
        SFTTrainConfig(learning_rate=5e-2, batch_size=2, num_epochs=1, seed=5),
        SFTTrainConfig(learning_rate=5e-2, batch_size=4, num_epochs=1, seed=6),
    ]
    one = Trainer.load(str(tiny_model_path), model_config=lora, device="cpu")
    one_metrics = [list(one.run(one.prepare_sft(trajectories, c))) for c in configs]
    one.save(tmp_path / "one")

    port = port_outside_the_ephemeral_range()
    nodes = {**TWO_NODES, "SKYTRAIN_TRAINER_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    follower = subprocess.Popen(
        [
            *(sys.executable, "-m", "skytrain_backend.worker.follower"),
            *("--work-dir", str(tmp_path / "node-1"), "--runs", "2"),
        ],
        env={**os.environ, **nodes, "SKYPILOT_NODE_RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        head = sharded_trainer(
            _options(tiny_model_path, tmp_path / "node-0", shards=2),
            "model-1",
            lora,
            None,
            env={**nodes, "SKYPILOT_NODE_RANK": "0"},
        )
        two_metrics = []
        for number, config in enumerate(configs):
            # The worker's job loop: prepare, run every step, save the checkpoint (the next
            # job starts from it: the follower gets it from rank 0).
            plan = head.prepare_sft(trajectories, config)
            two_metrics.append(list(head.run(plan)))
            head.save(tmp_path / f"checkpoint-{number}")
        output = follower.communicate(timeout=600)[0]
    finally:
        follower.kill()
    assert follower.returncode == 0, output[-3000:]
    for expected, got in zip(one_metrics, two_metrics, strict=True):
        _assert_same_metrics(expected, got)
    expected = load_file(str(tmp_path / "one" / ADAPTER))
    got = load_file(str(tmp_path / "checkpoint-1" / ADAPTER))
    update = torch.sqrt(sum((v.double() ** 2).sum() for k, v in expected.items() if "lora_B" in k))
    _assert_same_to_noise(expected, got, scale=float(update))
    expected_state = torch.load(tmp_path / "one" / OPTIMIZER_STATE, weights_only=True)["state"]
    got_state = torch.load(tmp_path / "checkpoint-1" / OPTIMIZER_STATE, weights_only=True)["state"]
    assert [s["step"] for s in got_state.values()] == [s["step"] for s in expected_state.values()]
    moments = {key: state["exp_avg"] for key, state in expected_state.items()}
    _assert_same_to_noise(
        moments,
        {key: state["exp_avg"] for key, state in got_state.items()},
        scale=float(torch.sqrt(sum((m.double() ** 2).sum() for m in moments.values()))),
    )
    # The second job's files on the follower's node came from rank 0: the data and the
    # checkpoint the job started from, the head's path nowhere.
    received = tmp_path / "node-1" / "run" / "job-0"
    assert (received / "data" / "data.json").is_file()
    assert (received / "adapter" / OPTIMIZER_STATE).is_file()
