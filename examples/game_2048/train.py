"""Train a 2048 agent with GRPO on a skytrain backend.

Each step plays --groups games (one seed each) --rollouts-per-group times, trains on the
scored games, and every --eval-every steps plays --eval-n held-out games.
"""

from __future__ import annotations

from collections.abc import Sequence

from examples.common import training
from examples.game_2048 import rollout


def main(argv: Sequence[str] | None = None) -> None:
    parser = training.training_parser(
        "examples.game_2048.train",
        __doc__,
        project=rollout.PROJECT,
        base_model=rollout.SEED_BASE_MODEL,
    )
    parser.add_argument(
        "--target",
        type=training.positive_int,
        default=128,
        help="tile that wins the game (default: %(default)s)",
    )
    parser.add_argument(
        "--max-turns",
        type=training.positive_int,
        default=40,
        help="moves per game at most (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=training.positive_int,
        default=32,
        help="tokens per answer at most (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    task = rollout.task(target=args.target, max_tokens=args.max_tokens, max_turns=args.max_turns)
    training.run(parser, args, task)


if __name__ == "__main__":
    main()
