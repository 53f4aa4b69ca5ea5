"""What a job's yield costs the worker, beside an optimizer step: the terms of the bound on how
long another tenant's job waits (slice + the step in progress + save and upload), and what the
job pays to resume.

An SFT job of --trajectories conversations of about --tokens tokens, --batch-size per step, on
the trainer alone (no control plane): the mean of --steps optimizer steps, then
``save_progress`` (the adapter, the optimizer state and ``progress.pt``) and the size of what a
worker uploads, then what resuming costs: ``Trainer.load`` from the saved state and
``prepare_sft(resume_from=)``. The upload and download add the object store's time for those
bytes (on the tiny model's ~1 MB, 0.35-0.41 s through a local control plane in
tests/e2e/test_preemption.py's log). 2026-12-06, SmolLM2-135M, LoRA rank 8, on a shared
2-core Xeon at load average 16 (so the times are upper bounds): the saved state is 29.7 MB
(adapter 9.8 MB, optimizer state 19.9 MB, progress.pt 7 KB), save_progress 1.3 s,
Trainer.load from it 11.3 s, prepare_sft(resume_from=) 0.1 s.

Usage:
    .venv/bin/python bench/yield_cost.py [--model PATH_OR_ID] [--steps 4] [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import machine
import torch

from skytrain_backend import hub
from skytrain_backend.protocol import ModelConfig, SFTTrainConfig, Trajectory
from skytrain_backend.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SENTENCE = "The lighthouse keeper wrote down every ship that passed the rocky cape. "


def _trajectories(count: int, tokens: int) -> list[Trajectory]:
    words = " ".join((SENTENCE * (tokens // 12 + 1)).split()[: max(tokens * 3 // 4, 1)])
    return [
        Trajectory.model_validate(
            {
                "messages_and_choices": [
                    {"role": "user", "content": f"Log entry {n}?"},
                    {"role": "assistant", "content": f"{n}: {words}"},
                ],
                "reward": 0,
            }
        )
        for n in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=hub.SMOLLM2_ID, help="model id or directory")
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="steps timed before the yield")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()

    model = str(hub.resolve_model(args.model, cache_dir=REPO / ".cache" / "models"))
    model_config = ModelConfig(lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank)
    trajectories = _trajectories(args.trajectories, args.tokens)
    config = SFTTrainConfig(learning_rate=1e-4, batch_size=args.batch_size, num_epochs=100)
    trainer = Trainer.load(model, model_config=model_config)
    plan = trainer.prepare_sft(trajectories, config)
    steps = trainer.run(plan)
    next(steps)  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        next(steps)
    step_s = (time.perf_counter() - start) / args.steps

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "saved"
        start = time.perf_counter()
        trainer.save_progress(plan, saved)
        save_s = time.perf_counter() - start
        sizes = {path.name: path.stat().st_size for path in sorted(saved.iterdir())}
        trainer.release()
        start = time.perf_counter()
        resumed = Trainer.load(model, model_config=model_config, adapter_dir=saved)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        resumed_plan = resumed.prepare_sft(trajectories, config, resume_from=saved)
        prepare_s = time.perf_counter() - start

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(
        f"machine: {machine.cpu_name()}, {os.cpu_count()} cores, {gpu}; torch threads "
        f"{torch.get_num_threads()}; load average {load} (shared machine)"
    )
    print(
        f"model: {args.model} on {trainer.policy.device}, LoRA rank {args.lora_rank}; "
        f"{args.trajectories} trajectories of ~{args.tokens} tokens, {args.batch_size} per step"
    )
    print(f"optimizer step (mean of {args.steps}): {step_s:.3f} s")
    print(f"save_progress after step {resumed_plan.steps_done}: {save_s:.3f} s")
    total = sum(sizes.values())
    print(
        f"saved state: {total / 1e6:.2f} MB ({', '.join(f'{n} {s:,} B' for n, s in sizes.items())})"
    )
    print(f"resume: Trainer.load {load_s:.3f} s, prepare_sft(resume_from=) {prepare_s:.3f} s")


if __name__ == "__main__":
    main()
