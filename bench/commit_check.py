"""What the commit's check of a checkpoint costs: reading each staged file back and hashing it.

``complete`` (``queue.complete_job``) reads every staged file back from the store and hashes it
(``ObjectStore.digest``, 1 MiB chunks) before copying it into place. This times, for one file
of ``--mib`` MiB on a local directory and on a SeaweedFS S3 server on loopback (as the suite
starts it): the digest, and the copy that the commit did before this check, in alternating
rounds.

Usage:
    .venv/bin/python bench/commit_check.py [--mib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from skytrain_backend.config import Settings
from skytrain_backend.storage import ObjectStore, open_object_store
from tests.fixtures.seaweedfs import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS


def _time(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _measure(store: ObjectStore, data: bytes, rounds: int) -> tuple[list[float], list[float]]:
    store.put_bytes("tenants/bench/staged", data)
    digests, copies = [], []
    for _ in range(rounds):
        digests.append(_time(lambda: store.digest("tenants/bench/staged")))
        copies.append(_time(lambda: store.copy("tenants/bench/staged", "tenants/bench/copied")))
    return digests, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = os.urandom(args.mib * 1024 * 1024)
    print(f"machine: {machine.cpu_name()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"python {platform.python_version()}; one file of {args.mib} MiB, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as home:
        local = open_object_store(f"file://{home}/objects", Settings())
        results = {"local": _measure(local, data, args.rounds)}
        os.environ.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION
        )
        with SeaweedFS.start(Path(home) / "seaweedfs") as seaweedfs:
            bucket = seaweedfs.make_bucket()
            settings = Settings(
                storage={"s3_endpoint_url": seaweedfs.endpoint, "s3_region": REGION}
            )
            s3 = open_object_store(f"s3://{bucket}/bench", settings)
            results["s3 (SeaweedFS, loopback)"] = _measure(s3, data, args.rounds)
    for name, (digests, copies) in results.items():
        digest, copy = statistics.median(digests), statistics.median(copies)
        print(
            f"{name:26} digest {digest:.2f} s ({args.mib / digest:.0f} MiB/s), "
            f"copy {copy:.2f} s: the check adds {digest / copy:.1f}x the copy"
        )


if __name__ == "__main__":
    main()
