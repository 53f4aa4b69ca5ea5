"""A node of a multi-node worker other than the head: its share of every sharded job's ranks.

A worker of several nodes (a SkyPilot task with ``num_nodes``) runs the worker agent on the
head node only (``SKYPILOT_NODE_RANK`` 0). Each other node runs this follower
(``python -m skytrain_backend.worker.follower``, sky/worker.yaml), which starts this node's
ranks of the next job with the same torchrun rendezvous as the head (``worker.sharded``:
node rank from ``SKYPILOT_NODE_RANK``, the head's address the first of ``SKYPILOT_NODE_IPS``),
waits for it to end, and starts them again for the next one.

How a follower learns that a job starts: it does not ask. Its torchrun waits at the head's
rendezvous (torchrun's static rendezvous: the head's torchrun hosts the store the other
nodes connect to), so the job starts when the head's torchrun does. Its ranks have none of
the worker's files: rank 0 sends the job's spec, data and the checkpoint it starts from over
the process group (``trainer.job.follow_jobs``), into this node's ``--work-dir``. Why this
and not an agent polling the head worker's front door: nothing new to authenticate or
expose (the front door stays the one open port, for the control plane and the gateway),
no second protocol to keep in step with the worker's job loop, and the nodes already reach
each other on the rendezvous port, which the trainer needs anyway. What it costs: a
follower that is not there when a job starts makes the head's ranks wait (up to the
collective timeout, 30 minutes) and then fail the job, which the control plane retries; a
torchrun that ends without a job (the rendezvous gave up, the head went away) is started
again after a pause.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from skytrain_backend.errors import ConfigurationError
from skytrain_backend.worker.sharded import Rendezvous, follower_command

logger = logging.getLogger(__name__)

# Between two runs: the head's torchrun (whose store the next run meets at) has ended.
PAUSE_S = 5.0


def gpus_per_node(env: Mapping[str, str]) -> int:
    """The ranks this node runs: SkyPilot's GPUs a node (the head shards its trainer over
    every GPU of every node), else the GPUs CUDA sees, else one (CPU)."""
    given = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def follower_rendezvous(env: Mapping[str, str], *, gpus: int) -> Rendezvous:
    rendezvous = Rendezvous.from_skypilot(env, gpus_per_node=gpus)
    if rendezvous.node_rank == 0:
        raise ConfigurationError(
            "this is the head node (SKYPILOT_NODE_RANK 0, or one node): it runs the worker "
            "(`skytrain worker`), not a follower"
        )
    return rendezvous


def follow(env: Mapping[str, str], *, work_dir: Path, gpus: int, runs: int | None = None) -> int:
    """Run this node's ranks of the head's jobs, one torchrun after the other (``runs`` of
    them; None: until stopped). The exit code of the last run."""
    rendezvous = follower_rendezvous(env, gpus=gpus)
    logger.info(
        "follower of node %d of %d: %d ranks a job, meeting at %s:%d",
        rendezvous.node_rank,
        rendezvous.nodes,
        rendezvous.gpus_per_node,
        rendezvous.master_addr,
        rendezvous.master_port,
    )
    done, code = 0, 0
    while runs is None or done < runs:
        directory = work_dir / "run"
        # Only the run in progress is kept.
        shutil.rmtree(directory, ignore_errors=True)
        code = subprocess.run(follower_command(directory, rendezvous), env=dict(env)).returncode
        done += 1
        if code != 0:
            logger.warning("this node's trainer ranks ended with exit code %d", code)
        if runs is None or done < runs:
            time.sleep(PAUSE_S)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m skytrain_backend.worker.follower",
        description="On a node of a multi-node worker other than the head: run this node's "
        "trainer ranks of every sharded job the head worker starts.",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path.home() / ".skytrain" / "follower",
        help="where the files of the job in progress are written (default: %(default)s)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="ranks on this node (default: SKYPILOT_NUM_GPUS_PER_NODE, else the GPUs CUDA sees, "
        "else 1)",
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="jobs to run, then end (default: until stopped)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    env = dict(os.environ)
    try:
        return follow(
            env,
            work_dir=args.work_dir,
            gpus=args.gpus or gpus_per_node(env),
            runs=args.runs,
        )
    except ConfigurationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
