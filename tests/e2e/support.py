"""What an RL client does, in a few plain functions: wait, sample, score, train, follow."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.chat.chat_completion import Choice

from skytrain_backend.child_processes import ChildProcess

PROMPTS = [
    "Name a fruit.",
    "Say hello.",
    "Count to three.",
    "What colour is the sky?",
]


def wait_until_served(
    http: httpx.Client, model_id: str, *, step: int | None = None, timeout_s: float = 300
) -> dict[str, Any]:
    """Poll the model until its endpoint serves ``step`` (or its latest); fail on 'failed'."""
    deadline = time.monotonic() + timeout_s
    serving: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = http.get(f"/v1/models/{model_id}")
        response.raise_for_status()
        serving = response.json()["serving"]
        if serving["state"] == "failed":
            raise AssertionError(f"serving failed: {serving['message']}")
        if serving["ready"] and (step is None or serving["step"] == step):
            return serving
        time.sleep(0.5)
    raise AssertionError(f"model {model_id} not served within {timeout_s}s: {serving}")


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


def sample(
    client: openai.OpenAI, model: str, prompt: str, *, n: int, max_tokens: int = 12
) -> tuple[list[Choice], httpx.Headers]:
    """``n`` sampled answers to ``prompt``, and the gateway's response headers."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        n=n,
        max_tokens=max_tokens,
        temperature=1.0,
    )
    return list(raw.parse().choices), raw.headers


def greedy(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12) -> list[float]:
    """The logprobs of a greedy answer: they tell checkpoints apart even when the text agrees."""
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
    )
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    return [entry.logprob for entry in content]


def same_policy(a: list[float], b: list[float], tolerance: float = 1e-3) -> bool:
    """Whether two greedy answers came from the same weights (up to batching noise)."""
    return len(a) == len(b) and all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def reward(choice: Choice) -> float:
    """A toy reward with spread: the share of letters among the answer's characters."""
    text = choice.message.content or ""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


def group(prompt: str, choices: list[Choice]) -> dict[str, Any]:
    """An ART-shaped trajectory group: the prompt, each sampled choice, its reward."""
    return {
        "trajectories": [
            {
                "messages_and_choices": [
                    {"role": "user", "content": prompt},
                    choice.model_dump(mode="json"),
                ],
                "reward": reward(choice),
            }
            for choice in choices
        ]
    }


def sample_groups(
    client: openai.OpenAI, model: str, *, groups: int = 4, n: int = 4, max_tokens: int = 12
) -> list[dict[str, Any]]:
    return [
        group(prompt, sample(client, model, prompt, n=n, max_tokens=max_tokens)[0])
        for prompt in (PROMPTS * groups)[:groups]
    ]


def events_until_end(
    http: httpx.Client, job_id: str, *, timeout_s: float = 300
) -> list[dict[str, Any]]:
    """Follow a job's events with the cursor, as a client does, until it ends."""
    events: list[dict[str, Any]] = []
    after: str | None = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        params = {"after": after} if after else {}
        page = http.get(f"/v1/training-jobs/{job_id}/events", params=params).json()
        events.extend(page["data"])
        if page["data"]:
            after = page["data"][-1]["id"]
        if events and events[-1]["type"] in ("training_ended", "training_failed"):
            return events
        if not page["has_more"]:
            time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not end within {timeout_s}s: {events[-3:]}")


def train(
    http: httpx.Client, model_id: str, groups: list[dict[str, Any]], **config: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    response = http.post(
        "/v1/training-jobs",
        json={"model_id": model_id, "trajectory_groups": groups, "config": config or None},
    )
    assert response.status_code == 201, response.text
    job = response.json()
    return job, events_until_end(http, job["id"])


def start_hand_worker(
    env: dict[str, str], home: Path, *, control_plane_url: str, join_token: str, base_model: Path
) -> ChildProcess:
    """``skytrain worker`` started by hand with a join token (as `sky launch sky/worker.yaml`
    does), its front door on loopback on a free port; its log is ``home/worker.log``."""
    home.mkdir(parents=True, exist_ok=True)
    worker_env = {
        **env,
        "SKYTRAIN_HOME": str(home),
        "SKYTRAIN_CONTROL_PLANE_URL": control_plane_url,
        "SKYTRAIN_WORKER_TOKEN": join_token,
        "SKYTRAIN_WORKER_BASE_MODEL": str(base_model),
        "SKYTRAIN_WORKER_HOST": "127.0.0.1",
        "SKYTRAIN_WORKER_PORT": "0",
    }
    with open(home / "worker.log", "wb") as log:
        return ChildProcess.start(
            [sys.executable, "-m", "skytrain_backend", "worker"], env=worker_env, stdout=log
        )
