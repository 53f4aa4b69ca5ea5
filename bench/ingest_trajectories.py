"""Ingest of a large trajectory batch through the API into S3, next to a plain boto3 upload.

Starts a SeaweedFS S3 server (``tests/fixtures/seaweedfs.py``, as the test suite does) and
`skytrain serve` as separate processes (SQLite by default, or --database-url), creates a key
and a model, then times:

- api:   POST /v1/training-jobs (or /v1/models/{id}/log) with N trajectories: the server
         parses and validates every group, writes the JSONL batch to S3, records the job.
- boto3: one put_object of the same request bytes to the same S3 server.
- writer: the same bytes through the server's own streaming upload, zstd-compressed as the
         API stores a batch (``compression.CompressingWriter`` over ``S3ObjectStore``'s
         ``open_writer``: a multipart upload, one part in flight), with no parsing at all:
         the least the API could take with the upload it makes, against this S3 server.

and the server's resident memory before the first batch and at its peak (Linux /proc).

Usage:
    .venv/bin/python bench/ingest_trajectories.py [--trajectories 10000] [--route log] [--token-ids]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import machine
import numpy

from skytrain_backend.storage import compression
from skytrain_backend.storage.s3 import S3ObjectStore

# The suite's S3 server, started the same way (the scripts run as `python bench/<name>.py`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS

BIN = Path(sys.executable).parent
# With --token-ids, each choice's prompt_token_ids (the system and user turns' tokens).
PROMPT_TOKENS = 120
_IDS = f" with token_ids and {PROMPT_TOKENS} prompt_token_ids"
STREAMED_KEY = "plain/streamed.jsonl"
VOCAB = 49152  # SmolLM2's
WORDS = [
    "up",
    "down",
    "left",
    "right",
    "merge",
    "the",
    "tile",
    "board",
    "move",
    "score",
    "empty",
    "corner",
    "row",
    "column",
    "next",
    "best",
    "keep",
    "high",
    "low",
    "because",
    "then",
    "so",
    "I",
    "will",
]
# The server writes one JSONL line per group: about this many bytes for the default batch.
WRITE_BYTES = 48 * 1024


def _wait(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within 60 s")


@contextmanager
def _process(
    args: list[str], env: dict[str, str], ready_url: str
) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(ready_url, process)
        yield process
    finally:
        process.terminate()
        process.wait(30)


def _choice(tokens: int, index: int, *, with_ids: bool) -> dict[str, Any]:
    # As a sampled answer looks: token ids spread over SmolLM2's vocabulary, logprobs as
    # float32 values written at full precision, text of varied words. A seeded generator
    # keeps runs comparable; repeated values would make the batch unrealistically easy to
    # compress (and to parse).
    rng = random.Random(index)
    ids = [rng.randrange(VOCAB) for _ in range(tokens)]
    logprobs = [float(numpy.float32(-rng.expovariate(4.0))) for _ in range(tokens)]
    choice = {
        "finish_reason": "stop",
        "index": 0,
        "logprobs": {
            "content": [
                {
                    "token": f"token_id:{token_id}",
                    "bytes": None,
                    "logprob": logprob,
                    "top_logprobs": [],
                }
                for token_id, logprob in zip(ids, logprobs, strict=True)
            ]
        },
        "message": {
            "role": "assistant",
            "content": " ".join(rng.choice(WORDS) for _ in range(tokens)),
            "tool_calls": None,
        },
    }
    if with_ids:  # as skytrain's endpoint returns a choice
        choice.update(prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)), token_ids=ids)
    return choice


def _groups(
    trajectories: int, group_size: int, tokens: int, *, with_ids: bool = False
) -> list[dict[str, Any]]:
    groups = []
    for g in range(trajectories // group_size):
        groups.append(
            {
                "trajectories": [
                    {
                        "messages_and_choices": [
                            {"role": "system", "content": "You play 2048. Answer with a move."},
                            {"role": "user", "content": f"Board {g}: " + "2 4 8 16 " * 8},
                            _choice(tokens, g * group_size + t, with_ids=with_ids),
                        ],
                        "reward": float(t % 3),
                        "metrics": {"max_tile": 64.0 * (t + 1), "invalid": 0.0},
                        "metadata": {"scenario": g},
                        "logs": [],
                    }
                    for t in range(group_size)
                ],
                "exceptions": [],
                "metadata": {},
                "metrics": {},
                "logs": [],
            }
        )
    return groups


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that size the batch (and how often it is timed), shared with
    ``bench/ingest_phases.py``."""
    parser.add_argument("--trajectories", type=int, default=10_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per trajectory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="choices carry prompt_token_ids and token_ids, as skytrain's endpoint returns them",
    )


def _alternating(repeats: int, actions: dict[str, Any]) -> dict[str, float]:
    """The median time of each action, run in turn ``repeats`` times after a first untimed
    round (imports, connection pools, first-use caches): a machine's load and the S3
    server's state drift over a run, and alternating spreads that over all of them."""
    times: dict[str, list[float]] = {name: [] for name in actions}
    for round_ in range(1 + repeats):
        for name, action in actions.items():
            start = time.perf_counter()
            action()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(series) for name, series in times.items()}


def _memory_mb(pid: int, field: str) -> float:
    """A figure of /proc/<pid>/status in MB: VmRSS (resident now), VmHWM (its peak so far),
    RssAnon (the process's own memory), RssFile (mapped file pages the kernel can drop)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} for process {pid}")


class _PeakSampler:
    """The largest RssAnon and RssFile of a process, sampled every 20 ms while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.anon_mb = self.file_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.anon_mb = max(self.anon_mb, _memory_mb(self.pid, "RssAnon"))
            self.file_mb = max(self.file_mb, _memory_mb(self.pid, "RssFile"))

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _hardware() -> str:
    return f"{machine.cpu_name()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser)
    parser.add_argument("--route", choices=["training-jobs", "log"], default="training-jobs")
    parser.add_argument("--database-url", help="default: SQLite in a temporary SKYTRAIN_HOME")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="skytrain-bench-"))
    api_port = machine.free_port()
    api = f"http://127.0.0.1:{api_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYTRAIN_")}
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION=REGION,
        SKYTRAIN_HOME=str(home),
        SKYTRAIN_OBJECT_STORE_URL="s3://bench/skytrain",
        SKYTRAIN_MAX_REQUEST_BYTES=str(1024**3),
        SKYTRAIN_PROVIDER="none",
    )
    if args.database_url:
        env["SKYTRAIN_DATABASE_URL"] = args.database_url
        subprocess.run([BIN / "skytrain", "db", "upgrade"], env=env, check=True)
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})

    groups = _groups(args.trajectories, args.group_size, args.tokens, with_ids=args.token_ids)
    try:
        with SeaweedFS.start(home / "seaweedfs") as seaweedfs:
            endpoint = env["SKYTRAIN_S3_ENDPOINT_URL"] = seaweedfs.endpoint
            s3 = seaweedfs.client()
            seaweedfs.make_bucket("bench")
            key = subprocess.run(
                [BIN / "skytrain", "keys", "create", "--tenant", "bench"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            serve = [str(BIN / "skytrain"), "serve", "--port", str(api_port)]
            with (
                _process(serve, env, f"{api}/health") as server,
                httpx.Client(
                    base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=600
                ) as http,
            ):
                model = http.post(
                    "/v1/models", json={"project": "bench", "name": "ingest", "base_model": "b"}
                ).json()
                if args.route == "log":
                    url, body = f"/v1/models/{model['id']}/log", {"trajectory_groups": groups}
                else:
                    url = "/v1/training-jobs"
                    body = {"model_id": model["id"], "trajectory_groups": groups}
                payload = json.dumps(body).encode()

                def through_api() -> None:
                    response = http.post(
                        url, content=payload, headers={"content-type": "application/json"}
                    )
                    response.raise_for_status()

                def plain_boto3() -> None:
                    s3.put_object(Bucket="bench", Key="plain/batch.json", Body=payload)

                store = S3ObjectStore(bucket="bench", endpoint_url=endpoint, region=REGION)

                def streamed() -> None:
                    writer = compression.CompressingWriter(store.open_writer(STREAMED_KEY))
                    for offset in range(0, len(payload), WRITE_BYTES):
                        writer.write(payload[offset : offset + WRITE_BYTES])
                    writer.commit()

                idle_mb = _memory_mb(server.pid, "VmRSS")
                idle_anon_mb = _memory_mb(server.pid, "RssAnon")
                with _PeakSampler(server.pid) as sampled:
                    medians = _alternating(
                        args.repeats,
                        {"api": through_api, "boto3": plain_boto3, "writer": streamed},
                    )
                peak_mb = _memory_mb(server.pid, "VmHWM")
                (streamed_object,) = store.list(STREAMED_KEY)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    api_s, boto3_s, writer_s = medians["api"], medians["boto3"], medians["writer"]
    database = "PostgreSQL" if args.database_url else "SQLite"
    print(f"hardware: {_hardware()}, no GPU")
    # Other processes on the machine slow both sides; the figures are only as clean as this.
    print(f"load:     1-minute load average {os.getloadavg()[0]:.1f} at the end of the run")
    print(
        f"batch:    {args.trajectories} trajectories in {len(groups)} groups, "
        f"{args.tokens} sampled tokens each{_IDS if args.token_ids else ''}, "
        f"{len(payload) / 1e6:.1f} MB of JSON"
    )
    print(
        f"setup:    skytrain serve ({database}) and SeaweedFS (weed server) on loopback, "
        "separate processes"
    )
    print(
        f"api:      POST {url.replace(model['id'], '{id}')}  median {api_s:.2f} s "
        f"({args.trajectories / api_s:,.0f} trajectories/s) over {args.repeats} runs"
    )
    print(f"boto3:    put_object of the same bytes  median {boto3_s:.2f} s")
    print(
        f"writer:   the same bytes through the server's streaming upload, compressed to "
        f"{streamed_object.size / 1e6:.1f} MB as the API stores them, no parsing  "
        f"median {writer_s:.2f} s ({writer_s / boto3_s:.1f}x boto3)"
    )
    print(f"ratio:    api / boto3 = {api_s / boto3_s:.2f}x; api / writer = {api_s / writer_s:.1f}x")
    print(
        f"memory:   server resident {idle_mb:.0f} MB before the first batch, peak "
        f"{peak_mb:.0f} MB over all runs (+{peak_mb - idle_mb:.0f} MB for a "
        f"{len(payload) / 1e6:.1f} MB body); its own (anonymous) memory peaked "
        f"+{sampled.anon_mb - idle_anon_mb:.0f} MB, mapped file pages at {sampled.file_mb:.0f} MB"
    )


if __name__ == "__main__":
    main()
