"""tinker-cookbook's ``sl_basic`` recipe, run by the cookbook's own training loop against
skytrain, offline: the tokenizer is a local model directory and the data a local JSONL file.

The recipe is ``tinker_cookbook.recipes.sl_basic``: its hyperparameters (linear learning-rate
schedule, one epoch, evaluation every few steps) and ``tinker_cookbook.supervised.train.main``
unchanged, with what the recipe itself says to swap for local use: the dataset
(``FromConversationFileBuilder``, whose held-out part the recipe's default evaluator, the
cookbook's ``SamplerNLLEvaluator``, scores with ``compute_logprobs``) and a model it does not
know, so a generic renderer (``role_colon``) instead of its recommended one.

    pip install --no-deps tinker-cookbook==0.6.1 chz blobfile cloudpickle pyrage termcolor \\
        tiktoken lxml pycryptodomex   # its other requirements are skytrain's already
    export TINKER_API_KEY=$(skytrain keys create --tenant me --tinker)
    python -m examples.tinker.cookbook_sl_basic --base-url http://127.0.0.1:8000 \\
        --base-model /path/to/a/local/model --data conversations.jsonl --log-path /tmp/sl_basic

(``--no-deps``: tinker-cookbook 0.6.1 also requires ``tml-renderers>=0.4.1``, which only its
Inkling and audio recipes import.) Without ``--data`` the cookbook's own example
conversations are used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

DEFAULT_RENDERER = "role_colon"


def example_conversations() -> Path:
    """The conversations file tinker-cookbook ships (``example_data/conversations.jsonl``)."""
    import tinker_cookbook

    return Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def build_config(
    *,
    base_url: str,
    model: str,
    data: Path,
    log_path: Path,
    test_size: int = 8,
    batch_size: int = 8,
    max_length: int = 512,
    max_steps: int | None = None,
    eval_every: int = 8,
    lora_rank: int = 32,
    renderer: str = DEFAULT_RENDERER,
) -> Any:
    """``sl_basic``'s configuration (``build_config_blueprint``'s values), for a local model
    and a local conversations file, with the held-out part its evaluator scores."""
    import chz
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common_config = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=renderer,
        max_length=max_length,
        batch_size=batch_size,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    dataset = FromConversationFileBuilder(
        common_config=common_config, file_path=str(data), test_size=test_size
    )
    # The recipe's own values, with the model, renderer and dataset swapped.
    recipe = sl_basic.build_config_blueprint(sl_basic.DEFAULT_MODEL_NAME)
    values: dict[str, Any] = {
        "log_path": str(log_path),
        "model_name": model,
        "recipe_name": "recipe_sl_basic",
        "renderer_name": renderer,
        "dataset_builder": dataset,
        "base_url": base_url,
        "lora_rank": lora_rank,
        "eval_every": eval_every,
        "max_steps": max_steps,
    }
    return chz.Blueprint(train.Config).apply(_recipe_values(recipe)).apply(values).make()


def _recipe_values(blueprint: Any) -> dict[str, Any]:
    """The hyperparameters ``sl_basic`` sets (learning rate, schedule, epochs), read from its
    blueprint rather than copied."""
    made = blueprint.make()  # builds nothing: its dataset builder loads data when called
    return {name: getattr(made, name) for name in ("learning_rate", "lr_schedule", "num_epochs")}


def run(config: Any) -> list[dict[str, Any]]:
    """Train with the cookbook's loop; the metrics it logged, one dict per step."""
    from tinker_cookbook.supervised import train

    asyncio.run(train.main(config))
    metrics = Path(config.log_path) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the skytrain control plane")
    parser.add_argument("--base-model", required=True, help="a local model directory")
    parser.add_argument("--data", type=Path, default=None, help="conversations JSONL")
    parser.add_argument("--log-path", type=Path, required=True)
    parser.add_argument(
        "--steps", type=int, default=None, help="default: every step of the recipe's epochs"
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    config = build_config(
        base_url=args.base_url,
        model=args.base_model,
        data=args.data or example_conversations(),
        log_path=args.log_path,
        max_steps=args.steps,
    )
    for step in run(config):
        print(step)


if __name__ == "__main__":
    main()
