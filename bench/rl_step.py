"""One RL step through skytrain next to the same step in TRL's ``GRPOTrainer``, in process.

Same model (SmolLM2-135M-Instruct, fp32 on CPU, LoRA r8 alpha 16 on the same modules), same
work: 2 prompts x 4 samples x exactly 16 tokens (ignore_eos / min_new_tokens), the same reward,
one optimizer step. The two alternate in one run: each round runs a skytrain step, then a TRL
step (TRL's trainer runs in a thread, held by a callback between its steps, so the two never
run at once). Round 0 warms both up and is left out of the medians.

skytrain's step is what a client lives through, against `skytrain serve` (embedded: SQLite,
local directory, a local worker): sample through the gateway (both prompts at once, n=4), queue
the job, follow its events, then ask until an answer comes from the new step. Its phases come
from the job's timestamps and events and the times the worker reports (``time/*_s``):

    sample        client wall time of the sampling requests
    queue         job created -> leased by the worker (its lease request, waiting on the
                  control plane, is answered at the job's notification)
    setup         leased -> trainer ready: download, engine asleep, trainer loaded (what is
                  left of leased -> last gradient_step after prepare and train)
      download    of it, the batch download
    prepare       the worker's ``time/prepare_s``: read, tokenize and pack the batch (and the
                  old-logprob pass, where the first step's forward pass does not read them)
    train         the worker's ``time/steps_s``: the optimizer steps and their events
    save          adapter + optimizer state written by the worker
    upload        checkpoint files to the control plane
    load          hot-load into the engine and check it serves (at the same time as upload)
    hand-off      upload and load together, wall time
    commit        the rest, until training_ended (the checkpoint row)
    first answer  training_ended -> the first answer served by the new step

TRL's step is ``on_step_begin`` -> ``on_step_end``: generation, rewards, loss, backward and the
optimizer step (its new weights serve at once: it is the same process).

Usage:
    .venv/bin/python bench/rl_step.py [--rounds 3] [--model-cache .cache/models]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import machine
import openai

from skytrain_backend import hub
from skytrain_backend.demo.service import EmbeddedService, embedded_service
from skytrain_backend.protocol import DEFAULT_LORA_TARGET_MODULES

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Name a fruit and say why you like it.", "Describe the sea in one sentence."]
SAMPLES_PER_PROMPT = 4
COMPLETION_TOKENS = 16
LEARNING_RATE = 5e-6
PHASES = (
    "sample",
    "queue",
    "setup",
    "download",
    "prepare",
    "train",
    "save",
    "upload",
    "load",
    "hand-off",
    "commit",
    "first answer",
)


def reward(text: str) -> float:
    """The share of letters among the answer's characters: a reward with spread."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


def _hardware() -> str:
    import torch

    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (
        f"{machine.cpu_name()}, {os.cpu_count()} cores, no GPU; torch threads "
        f"{torch.get_num_threads()} (TRL); load average {load} at the start"
    )


# --- skytrain -----------------------------------------------------------------------------------


class SkytrainClient:
    """What an RL client does against the control plane, one step at a time."""

    def __init__(self, service: EmbeddedService) -> None:
        headers = {"Authorization": f"Bearer {service.api_key}"}
        self.http = httpx.Client(base_url=service.url, headers=headers, timeout=600)
        self.openai = openai.OpenAI(
            base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0, timeout=600
        )
        response = self.http.post(
            "/v1/models",
            json={
                "project": "bench",
                "name": "rl-step",
                "base_model": hub.SMOLLM2_ID,
                "config": {"lora_rank": 8, "lora_alpha": 16},
            },
        )
        response.raise_for_status()
        self.model = response.json()
        self._wait_until_served()

    def _wait_until_served(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            serving = self.http.get(f"/v1/models/{self.model['id']}").json()["serving"]
            if serving["state"] == "failed":
                raise RuntimeError(f"the model's worker failed: {serving['message']}")
            if serving["ready"]:
                return
            time.sleep(0.5)
        raise RuntimeError("the model was not served in time")

    def _sample(self, prompt: str) -> dict[str, Any]:
        completion = self.openai.chat.completions.create(
            model=self.model["inference_name"],
            messages=[{"role": "user", "content": prompt}],
            n=SAMPLES_PER_PROMPT,
            max_tokens=COMPLETION_TOKENS,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return {
            "trajectories": [
                {
                    "messages_and_choices": [
                        {"role": "user", "content": prompt},
                        choice.model_dump(mode="json"),
                    ],
                    "reward": reward(choice.message.content or ""),
                }
                for choice in completion.choices
            ]
        }

    def step(self) -> dict[str, float]:
        """One RL step; the seconds of each phase, and ``total``."""
        begin = time.time()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            groups = list(pool.map(self._sample, PROMPTS))
        sampled = time.time()
        response = self.http.post(
            "/v1/training-jobs",
            json={
                "model_id": self.model["id"],
                "trajectory_groups": groups,
                "config": {"learning_rate": LEARNING_RATE},
            },
        )
        response.raise_for_status()
        job_id = response.json()["id"]
        events = self._events_until_end(job_id)
        if events[-1]["type"] != "training_ended":
            raise RuntimeError(f"job {job_id} failed: {events[-1]['data']}")
        step = int(events[-1]["data"]["step"])
        answered = self._first_answer_from(step)
        job = self.http.get(f"/v1/training-jobs/{job_id}").json()
        return _phases(begin, sampled, answered, job, events)

    def _events_until_end(self, job_id: str, timeout_s: float = 900) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            params = {"after": events[-1]["id"]} if events else {}
            page = self.http.get(f"/v1/training-jobs/{job_id}/events", params=params).json()
            events.extend(page["data"])
            if events and events[-1]["type"] in ("training_ended", "training_failed"):
                return events
            if not page["has_more"]:
                time.sleep(0.02)
        raise RuntimeError(f"job {job_id} did not end in time")

    def _first_answer_from(self, step: int, timeout_s: float = 120) -> float:
        """When (wall clock) the first answer served by ``step`` arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = self.openai.chat.completions.with_raw_response.create(
                model=self.model["inference_name"],
                messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=1,
            )
            if raw.headers.get("x-skytrain-step") == str(step):
                return time.time()
        raise RuntimeError(f"step {step} was not served in time")


def _timestamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def _phases(
    begin: float,
    sampled: float,
    answered: float,
    job: dict[str, Any],
    events: list[dict[str, Any]],
) -> dict[str, float]:
    last_step = [e for e in events if e["type"] == "gradient_step"][-1]
    ended = events[-1]
    times = ended["data"]
    leased_at = _timestamp(job["started_at"])
    trained_at = _timestamp(last_step["created_at"])
    ended_at = _timestamp(ended["created_at"])
    prepare, train = times["time/prepare_s"], times["time/steps_s"]
    handoff = times["time/handoff_s"]
    worker_after_train = times["time/save_s"] + handoff
    return {
        "sample": sampled - begin,
        "queue": leased_at - _timestamp(job["created_at"]),
        "setup": max(trained_at - leased_at - prepare - train, 0.0),
        "download": times["time/download_s"],
        "prepare": prepare,
        "train": train,
        "save": times["time/save_s"],
        "upload": times["time/upload_s"],
        "load": times["time/engine_load_s"],
        "hand-off": handoff,
        "commit": max(ended_at - trained_at - worker_after_train, 0.0),
        "first answer": answered - ended_at,
        "total": answered - begin,
        "gradient steps": float(sum(e["type"] == "gradient_step" for e in events)),
    }


# --- TRL ----------------------------------------------------------------------------------------


def _trl_stepper(
    model_path: str, output_dir: Path, steps: int, threads: int | None
) -> Callable[[], float]:
    """A GRPOTrainer running in a thread, one step per call; each call returns its seconds."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepGate(TrainerCallback):
        """Holds the training loop before each step until the bench lets one run."""

        def __init__(self) -> None:
            self.go = threading.Semaphore(0)
            self.done: queue.Queue[float] = queue.Queue()
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.go.acquire()
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.done.put(time.perf_counter() - self._start)

    def trl_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
        return [reward(completion[-1]["content"]) for completion in completions]

    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(PROMPTS) * SAMPLES_PER_PROMPT,
        num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=COMPLETION_TOKENS,
        generation_kwargs={"min_new_tokens": COMPLETION_TOKENS},
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        max_steps=steps,
        gradient_checkpointing=False,  # skytrain's default too
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    gate = StepGate()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=trl_reward,
        args=config,
        train_dataset=Dataset.from_list(
            [{"prompt": [{"role": "user", "content": prompt}]} for prompt in PROMPTS]
        ),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=list(DEFAULT_LORA_TARGET_MODULES),
            task_type="CAUSAL_LM",
        ),
        callbacks=[gate],
    )
    failure: list[BaseException] = []

    def train() -> None:
        if threads is not None:
            torch.set_num_threads(threads)  # OpenMP's thread count is per thread
        try:
            trainer.train()
        except BaseException as exc:
            failure.append(exc)
            gate.done.put(float("nan"))

    thread = threading.Thread(target=train, name="trl", daemon=True)
    thread.start()

    def step() -> float:
        gate.go.release()
        seconds = gate.done.get(timeout=900)
        if failure:
            raise RuntimeError("TRL's GRPOTrainer failed") from failure[0]
        return seconds

    return step


# --- the run ------------------------------------------------------------------------------------


def _line(label: str, values: dict[str, float]) -> str:
    cells = "  ".join(f"{values[name]:6.2f}" for name in (*PHASES, "total"))
    return f"{label:<10}{cells}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    parser.add_argument("--model-cache", type=Path, default=REPO / ".cache" / "models")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of the TRL trainer (default: torch's, every core). On a machine "
        "busy with other work, fewer threads than cores avoid a several-fold slowdown.",
    )
    args = parser.parse_args()

    model_path = hub.resolve_model(hub.SMOLLM2_ID, cache_dir=args.model_cache)
    print(
        f"model: {hub.SMOLLM2_ID} (fp32, LoRA r8 alpha 16 on {', '.join(DEFAULT_LORA_TARGET_MODULES)})"
    )
    if args.trl_threads is not None:
        import torch

        torch.set_num_threads(args.trl_threads)
    print(f"hardware: {_hardware()}")
    print(
        f"work per step: {len(PROMPTS)} prompts x {SAMPLES_PER_PROMPT} samples x "
        f"{COMPLETION_TOKENS} tokens, one optimizer step; {args.rounds} rounds after a warm-up"
    )
    with tempfile.TemporaryDirectory() as scratch:
        trl_step = _trl_stepper(
            model_path, Path(scratch) / "trl", steps=args.rounds + 1, threads=args.trl_threads
        )
        with embedded_service(
            Path(scratch) / "skytrain", port=machine.free_port(), model_cache_dir=args.model_cache
        ) as service:
            client = SkytrainClient(service)
            skytrain_rounds, trl_rounds = [], []
            header = "  ".join(f"{name[:6]:>6}" for name in (*PHASES, "total"))
            print(f"\nseconds   {header}")
            for index in range(args.rounds + 1):
                label = "warm-up" if index == 0 else f"round {index}"
                phases = client.step()
                trl_seconds = trl_step()
                print(_line(f"{label}", phases) + f"   TRL {trl_seconds:6.2f}")
                if index > 0:
                    skytrain_rounds.append(phases)
                    trl_rounds.append(trl_seconds)
    medians = {
        name: statistics.median(r[name] for r in skytrain_rounds)
        for name in (*PHASES, "total", "gradient steps")
    }
    trl_median = statistics.median(trl_rounds)
    print(_line("median", medians) + f"   TRL {trl_median:6.2f}")
    print(f"gradient steps per skytrain job: {medians['gradient steps']:.0f}")
    print(
        f"RL step: skytrain {medians['total']:.2f} s, TRL GRPOTrainer {trl_median:.2f} s; "
        f"skytrain / TRL = {medians['total'] / trl_median:.2f}"
    )


if __name__ == "__main__":
    main()
