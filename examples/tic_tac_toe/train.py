"""Train a tic-tac-toe agent with GRPO on a skytrain backend.

Each step plays --groups games (one seed each, the agent moving first on even seeds)
--rollouts-per-group times, trains on the scored games, and every --eval-every steps plays
--eval-n held-out games.
"""

from __future__ import annotations

from collections.abc import Sequence

from examples.common import training
from examples.tic_tac_toe import rollout
from skytrain_backend.games.tic_tac_toe.env import OPPONENTS


def main(argv: Sequence[str] | None = None) -> None:
    parser = training.training_parser(
        "examples.tic_tac_toe.train",
        __doc__,
        project=rollout.PROJECT,
        base_model=rollout.SEED_BASE_MODEL,
    )
    parser.add_argument(
        "--opponent",
        choices=OPPONENTS,
        default="random",
        help="random moves, or perfect play with random tie-breaks (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=training.positive_int,
        default=32,
        help="tokens per answer at most (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    task = rollout.task(opponent=args.opponent, max_tokens=args.max_tokens)
    training.run(parser, args, task)


if __name__ == "__main__":
    main()
