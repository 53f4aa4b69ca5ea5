"""Teach a model to answer in at most three words: the whole RL loop with the skytrain SDK.

Run `skytrain serve` (or point SKYTRAIN_BASE_URL at your control plane), set SKYTRAIN_API_KEY
(`skytrain keys create --tenant me`), then `python examples/quickstart.py`.
"""

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


async def main(base_model: str = "Qwen/Qwen2.5-0.5B-Instruct", steps: int = 20) -> None:
    backend = skytrain.Backend()  # SKYTRAIN_BASE_URL and SKYTRAIN_API_KEY
    model = skytrain.TrainableModel(name="brief", project="quickstart", base_model=base_model)
    await model.register(backend)  # waits until a worker serves it
    for _ in range(steps):
        groups = await skytrain.gather_trajectory_groups(
            skytrain.TrajectoryGroup(rollout(model, q) for _ in range(8)) for q in QUESTIONS
        )
        result = await model.train(groups, config=skytrain.TrainConfig(learning_rate=1e-4))
        print(f"step {result.step}: mean reward {result.metrics.get('train/reward', 0):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
