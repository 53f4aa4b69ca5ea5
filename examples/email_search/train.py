"""Train an email search agent with GRPO on a skytrain backend.

Each step answers --groups questions (one generated inbox each) --rollouts-per-group times
with the search_emails / read_email / answer tools, trains on the scored conversations, and
every --eval-every steps answers --eval-n held-out questions.
"""

from __future__ import annotations

from collections.abc import Sequence

from examples.common import training
from examples.email_search import rollout


def main(argv: Sequence[str] | None = None) -> None:
    parser = training.training_parser(
        "examples.email_search.train",
        __doc__,
        project=rollout.PROJECT,
        base_model=rollout.DEFAULT_BASE_MODEL,
    )
    parser.add_argument(
        "--inbox-size",
        type=training.positive_int,
        default=20,
        help="emails per inbox (default: %(default)s)",
    )
    parser.add_argument(
        "--max-turns",
        type=training.positive_int,
        default=6,
        help="tool-calling turns at most (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=training.positive_int,
        default=256,
        help="tokens per turn at most (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    task = rollout.task(
        inbox_size=args.inbox_size, max_tokens=args.max_tokens, max_turns=args.max_turns
    )
    training.run(parser, args, task)


if __name__ == "__main__":
    main()
