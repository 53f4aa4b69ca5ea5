"""Tinker runs on a worker whose engine shares the device with the trainer
(``SKYTRAIN_WORKER_SLEEP_ENGINE``, as vLLM on a GPU): each operation that computes takes the
trainer's turn, with the engine asleep, as a training job does; between operations the engine
serves. The official ``tinker`` SDK against ``skytrain serve`` with a local CPU worker; what
the worker did is read from its log."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest

import tinker
from tests.fixtures.service import Service
from tests.tinker.conftest import run_service, tinker_key
from tests.tinker.test_sdk import BATCH, TIMEOUT_S, new_training_client
from tinker import types

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def sleeping_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    yield from run_service(
        request,
        tmp_path_factory.mktemp("tinker-sleep-home"),
        overrides={"SKYTRAIN_WORKER_SLEEP_ENGINE": "true"},
    )


@pytest.fixture
def client(sleeping_service: Service) -> Iterator[Callable[[], tinker.ServiceClient]]:
    made: list[tinker.ServiceClient] = []

    def make() -> tinker.ServiceClient:
        made.append(
            tinker.ServiceClient(
                base_url=sleeping_service.url, api_key=tinker_key(sleeping_service, "alice")
            )
        )
        return made[-1]

    yield make
    for service_client in made:
        service_client.close("success").result(timeout=60)


@pytest.mark.slow
def test_the_engine_sleeps_around_each_tinker_operation_and_serves_between(
    client: Callable[[], tinker.ServiceClient], sleeping_service: Service, base_model: str
) -> None:
    training = new_training_client(client(), base_model)
    loss = training.forward_backward(BATCH, "cross_entropy").result(timeout=TIMEOUT_S)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT_S)
    assert loss.metrics["loss:sum"] > 0

    # Awake between operations: the new weights are sampled through the engine.
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    sampled = sampler.sample(
        prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3),
    ).result(timeout=TIMEOUT_S)
    assert 1 <= len(sampled.sequences[0].tokens) <= 4

    log = sleeping_service.worker_logs()
    slept = re.findall(r"the engine sleeps for Tinker run \S+: (\w+)", log)
    # Loading the model and each computing operation, in order, each with the engine asleep.
    assert slept[:4] == ["loading", "forward_backward", "optim_step", "save_weights_for_sampler"]
