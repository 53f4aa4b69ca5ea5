"""Where the server's time goes on one large training-job body, phase by phase, in-process.

The same steps as ``POST /v1/training-jobs`` after the bytes arrive (``api.ingest``), on the
batch ``bench/ingest_trajectories.py`` sends, with the lines written nowhere: no HTTP, no
store, no SQL. The phases:

- spool:  the body written to ``ingest.Spool`` in 64 KiB pieces, as the request streams it
- split:  ``split_body``: the fields validated, the raw bytes of each group found
- decode: each group decoded and validated (``parse_group``)
- turns:  the trainability rule on each group (``trainable_turns``)
- encode: each group written back as its JSONL line, compressed (``Batch.add``)

Usage:
    .venv/bin/python bench/ingest_phases.py [--trajectories 10000] [--repeats 5] [--token-ids]
        [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import machine
from ingest_trajectories import _IDS, _groups, add_batch_arguments

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import gc_paused
from skytrain_backend.api.schemas import TrainingJobCreate
from skytrain_backend.storage import ObjectWriter, compression

CHUNK_BYTES = 64 * 1024


class _Discard(ObjectWriter):
    """Takes the batch's lines and keeps none."""

    def write(self, data: bytes) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


# Wall-clock time; --cpu-time counts this process's CPU time instead (all its threads), which a
# busy shared machine disturbs far less.
_clock = time.perf_counter


def _phases(payload: bytes) -> dict[str, float]:
    times: dict[str, float] = defaultdict(float)
    start = _clock()
    spool = ingest.Spool()
    for offset in range(0, len(payload), CHUNK_BYTES):
        spool.write(payload[offset : offset + CHUNK_BYTES])
    times["spool"] = _clock() - start
    batch = ingest.Batch(limit=len(payload))
    batch.writer = compression.CompressingWriter(_Discard())
    try:
        with spool.view() as buffer:
            start = _clock()
            _, items = ingest.split_body(
                buffer, schema=TrainingJobCreate, list_field="trajectory_groups"
            )
            times["split"] = _clock() - start
            for index, raw in enumerate(items or []):
                start = _clock()
                group = ingest.parse_group(raw, f"trajectory_groups[{index}]")
                decoded = _clock()
                ingest.trainable_turns(group, index, allow_training_without_logprobs=False)
                counted = _clock()
                batch.add(group)
                times["decode"] += decoded - start
                times["turns"] += counted - decoded
                times["encode"] += _clock() - counted
            del items
    finally:
        batch.close()
        spool.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(parser)
    parser.add_argument(
        "--cpu-time", action="store_true", help="time the phases in CPU time, not wall time"
    )
    args = parser.parse_args()
    if args.cpu_time:
        global _clock
        _clock = time.process_time

    groups = _groups(args.trajectories, args.group_size, args.tokens, with_ids=args.token_ids)
    payload = json.dumps({"model_id": "m", "trajectory_groups": groups}).encode()
    _phases(payload)  # warm-up: imports and first-use caches
    with gc_paused():
        runs = [_phases(payload) for _ in range(args.repeats)]

    print(f"hardware: {machine.cpu_name()}, {os.cpu_count()} CPU cores, no GPU")
    print(f"load:     1-minute load average {os.getloadavg()[0]:.1f} at the end of the run")
    print(
        f"batch:    {args.trajectories} trajectories{_IDS if args.token_ids else ''}, "
        f"{len(payload) / 1e6:.1f} MB of JSON"
    )
    for phase in runs[0]:
        median = statistics.median(run[phase] for run in runs)
        print(f"{phase + ':':9} median {median:.3f} s over {args.repeats} runs")
    total = statistics.median(sum(run.values()) for run in runs)
    print(f"total:    median {total:.3f} s")


if __name__ == "__main__":
    main()
