"""Train a Temporal Clue solver with GRPO on a skytrain backend.

Each step asks for --rollouts-per-group answers to each of --groups puzzles, trains on the
scored answers, and every --eval-every steps solves --eval-n held-out puzzles.
"""

from __future__ import annotations

from collections.abc import Sequence

from examples.common import training
from examples.temporal_clue import rollout


def main(argv: Sequence[str] | None = None) -> None:
    parser = training.training_parser(
        "examples.temporal_clue.train",
        __doc__,
        project=rollout.PROJECT,
        base_model=rollout.SEED_BASE_MODEL,
    )
    for name, default in (("suspects", 3), ("weapons", 3), ("rooms", 3), ("hours", 4)):
        parser.add_argument(
            f"--{name}",
            type=training.positive_int,
            default=default,
            help=f"{name} in each puzzle (default: %(default)s)",
        )
    parser.add_argument(
        "--max-tokens",
        type=training.positive_int,
        default=1024,
        help="tokens per answer at most (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    task = rollout.task(
        suspects=args.suspects,
        weapons=args.weapons,
        rooms=args.rooms,
        hours=args.hours,
        max_tokens=args.max_tokens,
    )
    training.run(parser, args, task)


if __name__ == "__main__":
    main()
