"""One job trained by 2 processes (torchrun, gloo on loopback, the tiny model's layers sharded
with FSDP2) ends with the adapter and optimizer state one process ends with, to float noise:
an RL job driven by the worker's own ``ShardedTrainer``, yielding after its first step and
resumed by another, and an SFT job with LoRA dropout stopped and resumed by the ranks' entry
point itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skytrain_backend.protocol import ModelConfig, RLTrainConfig, SFTTrainConfig, Trajectory
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.job import JobSpec
from skytrain_backend.trainer.trainer import OPTIMIZER_STATE
from skytrain_backend.worker.sharded import Rendezvous, ShardedTrainer, torchrun_command
from tests.fixtures.ports import port_outside_the_ephemeral_range
from tests.fixtures.sampling import sampled_groups
from tests.trainer.test_resume import QUESTIONS, _answers

pytestmark = pytest.mark.distributed

ADAPTER = "adapter_model.safetensors"
# Two ranks sum their rows' gradients in another order than one process accumulates them, and
# Adam divides by the root of tiny second moments: a few elements move by far more than the
# rest. The runs agree when the whole difference is a small share of the whole update.
NOISE = 1e-3


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def _assert_same_to_noise(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *, scale: float
) -> None:
    assert expected.keys() == got.keys()
    difference = _norm([got[key] - value for key, value in expected.items()])
    assert scale > 0, "nothing moved: the comparison would prove nothing"
    assert difference <= NOISE * scale, (difference, scale)


def _sft_in_one_process(
    model: Path,
    trajectories: list[Trajectory],
    config: SFTTrainConfig,
    lora: ModelConfig,
    tmp: Path,
    *,
    output_dir: Path,
) -> tuple[list[dict[str, float]], JobSpec]:
    """The SFT job trained by one process and saved to ``tmp / "one"``: its steps' metrics, and
    the same job's spec for the ranks (its data written to ``tmp / "data.json"``)."""
    one = Trainer.load(str(model), model_config=lora, device="cpu")
    one_metrics = list(one.run(one.prepare_sft(trajectories, config)))
    one.save(tmp / "one")
    (tmp / "data.json").write_text(
        json.dumps([trajectory.model_dump(mode="json") for trajectory in trajectories])
    )
    spec = JobSpec(
        kind="sft",
        base_model=str(model),
        lora=lora,
        config=config.model_dump(mode="json"),
        data_path=tmp / "data.json",
        output_dir=output_dir,
        metrics_path=tmp / "events.jsonl",
        device="cpu",
    )
    return one_metrics, spec


def _sft_on_two_processes_stopped_and_resumed(spec: JobSpec, tmp: Path) -> list[dict[str, float]]:
    """The job stopped after its first step (rank 0 saves its progress), then resumed from
    the saved directory by a trainer loaded again, in the same two processes."""
    stopped = spec.model_copy(update={"output_dir": tmp / "stopped", "stop_after": 1})
    resumed = spec.model_copy(update={"output_dir": tmp / "two", "resume_from": tmp / "stopped"})
    specs = tmp / "jobs.json"
    specs.write_text("[" + ",".join(s.model_dump_json() for s in (stopped, resumed)) + "]")
    subprocess.run(
        torchrun_command(specs, Rendezvous(gpus_per_node=2)),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
        capture_output=True,
    )
    assert (tmp / "stopped" / "progress.pt").is_file()
    events = [json.loads(line) for line in spec.metrics_path.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names == ["prepared", "step", "stopped", "prepared", "step", "saved"]
    return [e["metrics"] for e in events if e["event"] == "step"]


def _assert_same_checkpoint(one: Path, two: Path) -> None:
    expected, got = load_file(str(one / ADAPTER)), load_file(str(two / ADAPTER))
    # The B matrices start at zero: their norm is the update's.
    update = _norm([value for name, value in expected.items() if "lora_B" in name])
    _assert_same_to_noise(expected, got, scale=update)
    configs = [json.loads((d / "adapter_config.json").read_text()) for d in (one, two)]
    for config in configs:
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]
    expected_state = torch.load(one / OPTIMIZER_STATE, weights_only=True)["state"]
    got_state = torch.load(two / OPTIMIZER_STATE, weights_only=True)["state"]
    assert expected_state.keys() == got_state.keys()
    for name in ("exp_avg", "exp_avg_sq"):
        moments = {key: state[name] for key, state in expected_state.items()}
        _assert_same_to_noise(
            moments,
            {key: state[name] for key, state in got_state.items()},
            scale=_norm(list(moments.values())),
        )
    assert [s["step"] for s in got_state.values()] == [s["step"] for s in expected_state.values()]
    assert json.loads((two / "trainer_state.json").read_text())["step"] == 1


def _assert_same_metrics(one: list[dict[str, float]], two: list[dict[str, float]]) -> None:
    assert len(one) == len(two)
    for expected, got in zip(one, two, strict=True):
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_an_rl_job_on_two_processes_updates_as_one(tiny_model_path: Path, tmp_path: Path) -> None:
    sampler = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    # 3 + 2 + 3 + 2 trajectories in 2 steps: a step of 5 rows gives one rank a padding row.
    groups = sampled_groups(
        sampler, [[0.0, 1.0, 0.5], [1.0, 0.0], [0.2, 0.9, 0.4], [0.7, 0.1]], questions=QUESTIONS
    )
    config = RLTrainConfig(learning_rate=5e-2, num_gradient_steps=2, seed=3)
    one = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    one_plan = one.prepare_rl(groups, config)
    one_metrics = list(one.run(one_plan))
    one.save(tmp_path / "one")

    def sharded(adapter_dir: Path | None, name: str) -> ShardedTrainer:
        return ShardedTrainer(
            str(tiny_model_path),
            model_config=ModelConfig(),
            adapter_dir=adapter_dir,
            rendezvous=Rendezvous(gpus_per_node=2),
            work_dir=tmp_path / name,
            device="cpu",
            env={"OMP_NUM_THREADS": "1"},
        )

    # The worker's job loop: a step, then a yield to another job at the step boundary.
    first = sharded(None, "first")
    plan = first.prepare_rl(groups, config)
    steps = first.run(plan)
    before = next(steps)
    assert (plan.steps_done, plan.num_gradient_steps) == (1, 2)
    assert plan.summary == pytest.approx(one_plan.summary)
    first.save_progress(plan, tmp_path / "stopped")
    # Another worker resumes it from the saved state and commits the next step.
    second = sharded(tmp_path / "stopped", "second")
    assert second.step == 0
    resumed = second.prepare_rl(groups, config, resume_from=tmp_path / "stopped")
    # Where it stopped is known before the ranks start: the worker reports it resumed.
    assert (resumed.steps_done, resumed.num_gradient_steps) == (1, 2)
    assert not resumed.agreement_pending and resumed.step_metrics == [pytest.approx(before)]
    after = list(second.run(resumed))
    assert resumed.steps_done == resumed.num_gradient_steps == 2
    assert second.step == 1
    second.save(tmp_path / "two")
    _assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    _assert_same_metrics(one_metrics, [before, *after])
    assert [e["event"] for e in second.events] == ["loaded", "gradient_step", "saved"]


@pytest.mark.slow
def test_an_sft_job_with_dropout_on_two_processes_updates_as_one(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """With LoRA dropout too: each row draws its masks from a generator of its own, so the
    rank that runs it draws what one process draws."""
    trajectories = _answers(5)
    config = SFTTrainConfig(learning_rate=5e-2, batch_size=3, num_epochs=1, seed=7)
    # Rows of 64 tokens hold one answer each: 3 rows, then 2, split over the ranks.
    lora = ModelConfig(lora_dropout=0.3, max_seq_length=64)
    one_metrics, spec = _sft_in_one_process(
        tiny_model_path, trajectories, config, lora, tmp_path, output_dir=tmp_path / "unused"
    )
    two = _sft_on_two_processes_stopped_and_resumed(spec, tmp_path)
    _assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    _assert_same_metrics(one_metrics, two)


@pytest.mark.slow
def test_an_sft_job_on_two_nodes_updates_as_one(tiny_model_path: Path, tmp_path: Path) -> None:
    """Two "nodes" on this host: two torchrun launches of one process each, with the node
    ranks and head address SkyPilot's environment gives (``Rendezvous.from_skypilot``), meet
    on gloo and make the update one process makes. Both read the spec and data from this
    host's disk: on real nodes the head would have to send them (docs/operators.md)."""
    trajectories = _answers(4)
    config = SFTTrainConfig(learning_rate=5e-2, batch_size=2, num_epochs=1, seed=5)
    lora = ModelConfig(max_seq_length=64)
    one_metrics, spec = _sft_in_one_process(
        tiny_model_path, trajectories, config, lora, tmp_path, output_dir=tmp_path / "two"
    )
    (tmp_path / "job.json").write_text(spec.model_dump_json())
    port = port_outside_the_ephemeral_range()
    skypilot = {
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n",
        "SKYTRAIN_TRAINER_MASTER_PORT": str(port),
    }
    nodes = [
        Rendezvous.from_skypilot({**skypilot, "SKYPILOT_NODE_RANK": rank}, gpus_per_node=1)
        for rank in ("0", "1")
    ]
    assert [(node.nodes, node.node_rank, node.world_size) for node in nodes] == [
        (2, 0, 2),
        (2, 1, 2),
    ]
    runs = [
        subprocess.Popen(
            torchrun_command(tmp_path / "job.json", node),
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in nodes
    ]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    events = [json.loads(line) for line in spec.metrics_path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["prepared", "step", "step", "saved"]
    _assert_same_checkpoint(tmp_path / "one", tmp_path / "two")
    _assert_same_metrics(one_metrics, [e["metrics"] for e in events if e["event"] == "step"])
