"""openpipe-art 0.5.23's ServerlessBackend against skytrain, written as an ART user writes it.

Run by ``test_art_client.py`` in ART's own environment (``scripts/art-venv.sh``, Python 3.12)::

    python art_client_flow.py <control plane URL> <API key> <base model>

It registers a model, samples rollouts through the model's endpoint with ART's client, trains
twice with ``backend.train``'s defaults, asks for each ``:step<N>``, then
``model.delete_checkpoints()`` and ``backend.delete(model)``, and prints what it saw as one JSON
line. Any error ends it with ART's own traceback.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import art
import openai
from art.serverless.backend import ServerlessBackend

PROMPTS = ["Name a fruit.", "Say hello."]
WAIT_S = 600


def letter_share(text: str) -> float:
    """A reward with spread on a random model's text: the share of letters in it."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


async def rollout(model: art.TrainableModel, prompt: str) -> art.Trajectory:
    messages: Any = [{"role": "user", "content": prompt}]
    # A new model's endpoint answers 503 (with Retry-After) until a worker serves it.
    for _ in range(WAIT_S):
        try:
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(),
                messages=messages,
                max_tokens=8,
                temperature=1.0,
            )
        except openai.InternalServerError:
            await asyncio.sleep(1.0)
            continue
        choice = completion.choices[0]
        return art.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=letter_share(choice.message.content or ""),
        )
    raise TimeoutError(f"{model.get_inference_name()} was not served within {WAIT_S} s")


async def groups(model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    return [
        art.TrajectoryGroup([await rollout(model, prompt) for _ in range(3)]) for prompt in PROMPTS
    ]


async def served_step(model: art.TrainableModel, step: int) -> str | int:
    """The step skytrain says answered a request for ``:step<step>``, or the error status."""
    assert model.inference_base_url is not None and model.inference_api_key is not None
    async with openai.AsyncOpenAI(
        base_url=model.inference_base_url, api_key=model.inference_api_key, max_retries=30
    ) as client:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=model.get_inference_name(step),
                messages=[{"role": "user", "content": "Hi."}],
                max_tokens=2,
            )
        except openai.APIStatusError as exc:
            return exc.status_code
        return raw.headers["x-skytrain-step"]


async def main(url: str, api_key: str, base_model: str) -> dict[str, Any]:
    backend = ServerlessBackend(api_key=api_key, base_url=f"{url}/v1")
    model = art.TrainableModel(
        name="art-client", project="art-e2e", run_name="run-1", base_model=base_model
    )
    await model.register(backend)
    seen: dict[str, Any] = {"registered_step": await model.get_step()}
    first = await backend.train(model, await groups(model))
    seen["first"] = {"step": first.step, "metrics": first.metrics}
    seen["served_after_first"] = await served_step(model, 1)
    second = await backend.train(model, await groups(model))
    seen["second"] = {"step": second.step, "metrics": second.metrics}
    seen["served_after_second"] = {step: await served_step(model, step) for step in (1, 2)}
    await model.delete_checkpoints()
    seen["served_after_delete_checkpoints"] = {
        step: await served_step(model, step) for step in (1, 2)
    }
    seen["step_after_delete_checkpoints"] = await model.get_step()
    await backend.delete(model)
    seen["served_after_delete"] = await served_step(model, 2)
    await backend.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
