"""The official ``tinker`` SDK, unmodified, against ``skytrain serve`` and a local CPU worker with
the tiny model: training clients, futures, sampling, state, checkpoints and tenants."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import httpx
import openai
import pytest
from sqlalchemy import func, select
from tinker.proto.request_conv import forward_backward_request_to_proto

import tinker
from skytrain_backend.config import Settings
from skytrain_backend.db.models import TinkerRequest
from skytrain_backend.db.session import create_db_engine
from tests.fixtures.service import Service
from tests.tinker.conftest import tinker_key
from tinker import types

pytestmark = [pytest.mark.e2e]

TIMEOUT_S = 600
SEQUENCES = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 8, 16, 32, 64, 128], [7, 7, 7, 7, 7, 7, 7]]

ClientFactory = Callable[..., tinker.ServiceClient]


def sl_datum(tokens: list[int]) -> types.Datum:
    """Learn every next token of ``tokens``."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
            "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
        },
    )


BATCH = [sl_datum(tokens) for tokens in SEQUENCES]


def train_step(client: tinker.TrainingClient, learning_rate: float = 1e-2) -> float:
    """One cross-entropy step on BATCH (both submitted before waiting); the loss before it."""
    fwd_bwd = client.forward_backward(BATCH, "cross_entropy")
    optim = client.optim_step(types.AdamParams(learning_rate=learning_rate))
    loss = fwd_bwd.result(timeout=TIMEOUT_S).metrics["loss:sum"]
    optim.result(timeout=TIMEOUT_S)
    return loss


def new_training_client(
    service_client: tinker.ServiceClient, base_model: str
) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(base_model=base_model, rank=8, seed=1).result(
        timeout=TIMEOUT_S
    )


@pytest.mark.slow
def test_cross_entropy_steps_lower_the_loss_and_saves_are_ordinary_checkpoints(
    tinker_client: ClientFactory, tinker_service: Service, base_model: str
) -> None:
    training = new_training_client(tinker_client("alice"), base_model)
    assert training.get_info().lora_rank == 8
    assert training.get_info().model_data.model_name == base_model

    losses = [train_step(training) for _ in range(4)]
    after = training.forward(BATCH, "cross_entropy").result(timeout=TIMEOUT_S)
    print(f"cross_entropy loss over steps: {losses} -> {after.metrics['loss:sum']}")
    assert losses[-1] < losses[0]
    assert after.metrics["loss:sum"] < losses[-1]
    # Each datum's output holds the target tokens' logprobs, whose weighted sum is the loss.
    assert [len(out["logprobs"].tolist()) for out in after.loss_fn_outputs] == [6, 6, 6]
    summed = -sum(sum(out["logprobs"].tolist()) for out in after.loss_fn_outputs)
    assert summed == pytest.approx(after.metrics["loss:sum"], rel=1e-5)

    saved = training.save_weights_for_sampler("after-four").result(timeout=TIMEOUT_S)
    assert saved.path == f"tinker://{training.model_id}/sampler_weights/after-four"

    # An ordinary skytrain checkpoint: listed by the REST API, with the usual files...
    with tinker_service.http("alice") as http:
        models = http.get("/v1/models", params={"project": "tinker", "limit": 100}).json()["data"]
        model = next(m for m in models if m["name"] == training.model_id.replace(":", "-"))
        checkpoints = http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
        assert [c["step"] for c in checkpoints] == [0, 1]
        files = http.get(f"/v1/models/{model['id']}/checkpoints/1/files").json()["data"]
        assert {f["name"] for f in files} >= {
            "adapter_config.json",
            "adapter_model.safetensors",
            "optimizer.pt",
            "trainer_state.json",
        }
    # ...and served by the OpenAI gateway by name and step.
    gateway = openai.OpenAI(
        base_url=f"{tinker_service.url}/v1", api_key=tinker_service.key("alice"), max_retries=0
    )
    raw = gateway.completions.with_raw_response.create(
        model=f"{model['inference_name']}:step1", prompt="Hello", max_tokens=3
    )
    assert raw.headers["x-skytrain-step"] == "1"
    assert raw.parse().choices[0].text is not None

    # The Tinker API lists the run and its named checkpoint.
    rest = tinker.RestClient(
        base_url=tinker_service.url, api_key=tinker_key(tinker_service, "alice")
    )
    run = rest.get_training_run(training.model_id).result(timeout=60)
    assert run.base_model == base_model and run.lora_rank == 8
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == saved.path
    listed = rest.list_checkpoints(training.model_id).result(timeout=60)
    assert [c.tinker_path for c in listed.checkpoints] == [saved.path]
    runs = rest.list_training_runs().result(timeout=60)
    assert training.model_id in [r.training_run_id for r in runs.training_runs]

    # Every byte the run stored is in the tenant's running total, the forward passes' outputs
    # included: the check recounts each tenant from its rows and finds no difference.
    with tinker_service.http("alice") as http:
        quotas = {q["name"]: q["used"] for q in http.get("/v1/usage").json()["quotas"]}
    url = tinker_service.env.get("SKYTRAIN_DATABASE_URL") or (
        Settings(storage={"home": tinker_service.home}).storage.resolved_database_url
    )
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            outputs = connection.scalar(
                select(func.sum(TinkerRequest.output_bytes)).where(
                    TinkerRequest.run_id == training.model_id
                )
            )
    finally:
        engine.dispose()
    assert (outputs or 0) > 0  # five forward passes' outputs
    assert quotas["max_storage_bytes"] > sum(f["size"] for f in files) + outputs
    assert "Every tenant's stored bytes match its rows." in tinker_service.cli("storage", "check")


@pytest.mark.slow
def test_sampled_tokens_and_logprobs_agree_with_forward(
    tinker_client: ClientFactory, base_model: str
) -> None:
    training = new_training_client(tinker_client("alice"), base_model)
    train_step(training)  # a trained adapter, not the base model
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    prompt = [1, 2, 3, 4, 5]
    result = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=11),
    ).result(timeout=TIMEOUT_S)
    assert len(result.sequences) == 3
    assert len({seq.sequence_id for seq in result.sequences}) == 3

    datums = []
    for seq in result.sequences:
        assert seq.logprobs is not None and 1 <= len(seq.tokens) == len(seq.logprobs) <= 6
        pad = len(prompt) - 1
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=[0] * pad + seq.tokens, dtype="int64"),
                    "logprobs": types.TensorData(data=[0.0] * pad + seq.logprobs, dtype="float32"),
                    "advantages": types.TensorData(
                        data=[0.0] * pad + [1.0] * len(seq.tokens), dtype="float32"
                    ),
                },
            )
        )
    forward = training.forward(datums, "importance_sampling").result(timeout=TIMEOUT_S)
    differences = [
        abs(trained - sampled)
        for out, seq in zip(forward.loss_fn_outputs, result.sequences, strict=True)
        for trained, sampled in zip(
            out["logprobs"].tolist()[len(prompt) - 1 :], seq.logprobs or [], strict=True
        )
    ]
    print(f"tiny model: max |forward - sampled| logprob = {max(differences):.2e}")
    assert max(differences) < 1e-3
    # The importance ratio of on-policy tokens is 1: the loss is minus their count.
    sampled_tokens = sum(len(seq.tokens) for seq in result.sequences)
    assert forward.metrics["loss:sum"] == pytest.approx(-sampled_tokens, rel=1e-3)


@pytest.mark.slow
def test_save_state_and_load_state_resume_identically(
    tinker_client: ClientFactory, base_model: str
) -> None:
    service_client = tinker_client("alice")
    training = new_training_client(service_client, base_model)
    train_step(training)
    train_step(training)
    state = training.save_state("two-steps").result(timeout=TIMEOUT_S)
    assert state.path == f"tinker://{training.model_id}/weights/two-steps"
    continued = [train_step(training) for _ in range(2)]

    resumed = service_client.create_training_client_from_state_with_optimizer(state.path).result(
        timeout=TIMEOUT_S
    )
    assert resumed.model_id != training.model_id
    assert [train_step(resumed) for _ in range(2)] == pytest.approx(continued, rel=1e-5)

    # The older load_state on the live client rewinds it the same way.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        training.load_state_with_optimizer(state.path).result(timeout=TIMEOUT_S)
    assert [train_step(training) for _ in range(2)] == pytest.approx(continued, rel=1e-5)


def test_bad_operations_fail_their_futures_and_the_run_goes_on(
    tinker_client: ClientFactory, base_model: str
) -> None:
    training = new_training_client(tinker_client("alice"), base_model)
    missing_advantages = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64")},
    )
    with pytest.raises(tinker.RequestFailedError, match=r"lacks \['logprobs', 'advantages'\]"):
        training.forward_backward([missing_advantages], "ppo").result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.RequestFailedError, match="'gspo' is not served by skytrain"):
        training.forward_backward(BATCH, "gspo").result(timeout=TIMEOUT_S)
    outside = sl_datum([1, 2, 10**7])  # no such token in the vocabulary
    with pytest.raises(tinker.RequestFailedError, match="outside the model's vocabulary"):
        training.forward_backward([outside], "cross_entropy").result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.RequestFailedError, match="learning_rate"):
        training.optim_step(types.AdamParams(learning_rate=-1.0)).result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.RequestFailedError, match="'no spaces' is not valid"):
        training.save_state("no spaces").result(timeout=TIMEOUT_S)
    # A name taken is refused as the second save commits, and as a third is sent.
    first, second = training.save_state("taken"), training.save_state("taken")
    assert first.result(timeout=TIMEOUT_S).path.endswith("/weights/taken")
    for save in (second, training.save_state("taken")):
        with pytest.raises(tinker.RequestFailedError, match="already has a checkpoint named"):
            save.result(timeout=TIMEOUT_S)
    # The refused operations left nothing behind: the first real step has nothing pending.
    first = train_step(training)
    assert train_step(training) < first


@pytest.mark.slow
def test_another_tenants_key_cannot_touch_the_model(
    tinker_client: ClientFactory, tinker_service: Service, base_model: str
) -> None:
    alice = tinker_client("alice")
    training = new_training_client(alice, base_model)
    before = train_step(training)
    saved = training.save_state("mine").result(timeout=TIMEOUT_S)
    alices_future = _sampling_request(tinker_service, "alice", base_model)

    mallory = tinker_key(tinker_service, "mallory")
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=BATCH, loss_fn="cross_entropy"),
        model_id=training.model_id,
        seq_id=100,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    session = tinker_client("mallory").holder.get_session_id()
    attempts = [
        (
            "POST",
            "/api/v1/forward_backward",
            {"content": body, "headers": {"Content-Type": "application/x-protobuf"}},
        ),
        (
            "POST",
            "/api/v1/optim_step",
            {"json": {"model_id": training.model_id, "seq_id": 101, "adam_params": {}}},
        ),
        (
            "POST",
            "/api/v1/save_weights",
            {"json": {"model_id": training.model_id, "seq_id": 102, "path": "theirs"}},
        ),
        ("POST", "/api/v1/get_info", {"json": {"model_id": training.model_id}}),
        ("POST", "/api/v1/retrieve_future", {"json": {"request_id": alices_future}}),
        ("GET", f"/api/v1/training_runs/{training.model_id}", {}),
        ("GET", f"/api/v1/training_runs/{training.model_id}/checkpoints", {}),
        (
            "POST",
            "/api/v1/create_sampling_session",
            {"json": {"session_id": session, "model_path": saved.path}},
        ),
        (
            "POST",
            "/api/v1/load_weights",
            {
                "json": {
                    "session_id": session,
                    "model_seq_id": 7,
                    "path": saved.path,
                    "optimizer": True,
                }
            },
        ),
    ]
    with httpx.Client(
        base_url=tinker_service.url, headers={"X-API-Key": mallory}, timeout=60
    ) as http:
        for method, path, kwargs in attempts:
            response = http.request(method, path, **kwargs)
            assert response.status_code == 404, (path, response.text)
            assert response.json()["error"]["type"] == "not_found_error"
        listed = http.get("/api/v1/training_runs").json()["training_runs"]
        assert training.model_id not in [run["training_run_id"] for run in listed]
        assert http.get("/api/v1/checkpoints").json()["checkpoints"] == []
        # No key, or a made-up one: 401 saying what to send.
        anonymous = httpx.post(f"{tinker_service.url}/api/v1/get_info", json={"model_id": "x"})
        assert anonymous.status_code == 401 and "TINKER_API_KEY" in anonymous.text
        wrong = http.post(
            "/api/v1/get_info", json={"model_id": "x"}, headers={"X-API-Key": "tml-sk-st-nope"}
        )
        assert wrong.status_code == 401

    # Alice's run is untouched: nothing was queued on it in between.
    assert train_step(training) < before


def _sampling_request(service: Service, tenant: str, base_model: str) -> str:
    """The id of a future of ``tenant``'s (a sample from the base model), made over HTTP."""
    with httpx.Client(
        base_url=service.url, headers={"X-API-Key": tinker_key(service, tenant)}, timeout=60
    ) as http:
        session_id = http.post("/api/v1/create_session", json={}).json()["session_id"]
        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": session_id, "base_model": base_model},
        ).json()["sampling_session_id"]
        response = http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2},
            },
        )
        assert response.status_code == 200, response.text
        request_id: str = response.json()["request_id"]
        http.post(f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}})
        return request_id


def test_keys_create_tinker_prints_a_key_the_sdk_accepts(tinker_service: Service) -> None:
    key = tinker_service.cli("keys", "create", "--tenant", "carol", "--tinker").strip()
    assert key.startswith("tml-sk-st-")
    rest = tinker.RestClient(base_url=tinker_service.url, api_key=key)
    assert rest.list_training_runs().result(timeout=60).training_runs == []


def test_values_the_database_cannot_hold_are_refused_naming_the_field(
    tinker_service: Service,
) -> None:
    """NUL in text (PostgreSQL refuses it), integers past their columns, over-long paths: 400
    naming the field, before anything is stored."""
    with httpx.Client(
        base_url=tinker_service.url,
        headers={"X-API-Key": tinker_key(tinker_service, "nul")},
        timeout=60,
    ) as http:
        refused = [
            ("/api/v1/create_session", {"sdk_version": "\x00"}, "sdk_version"),
            ("/api/v1/create_session", {"tags": ["a\x00"]}, "tags"),
            ("/api/v1/create_session", {"user_metadata": {"k": ["\x00"]}}, "user_metadata"),
            ("/api/v1/create_session", {"user_metadata": {"k": 2**70}}, "user_metadata"),
            ("/api/v1/get_info", {"model_id": "run\x00"}, "model_id"),
            ("/api/v1/optim_step", {"model_id": "r", "seq_id": 2**40}, "seq_id"),
            ("/api/v1/weights_info", {"tinker_path": "tinker://x" * 200}, "tinker_path"),
        ]
        for path, body, field in refused:
            response = http.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            assert field in response.text, response.text
        assert http.get("/api/v1/training_runs", params={"offset": 2**40}).status_code == 400
        assert http.get("/api/v1/samplers/a%00b").status_code == 400
        # Nothing was created: the tenant has no session, hence no runs.
        assert http.get("/api/v1/training_runs").json()["training_runs"] == []


@pytest.mark.slow
def test_a_sample_result_past_the_storage_quota_fails_and_is_not_kept(
    tinker_client: ClientFactory, tinker_service: Service, base_model: str
) -> None:
    """A sample's result, kept in the database, was neither counted nor refused."""
    tenant = "sample-quota"
    sampler = tinker_client(tenant).create_sampling_client(base_model=base_model).result(timeout=60)

    def used() -> int:
        with tinker_service.http(tenant) as http:
            quotas = {q["name"]: q["used"] for q in http.get("/v1/usage").json()["quotas"]}
        return int(quotas["max_storage_bytes"])

    def sample() -> types.SampleResponse:
        return sampler.sample(
            prompt=types.ModelInput.from_ints([1, 2, 3]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3),
        ).result(timeout=TIMEOUT_S)

    held = used()
    tinker_service.cli("tenants", "limits", tenant, "--max-storage-bytes", str(held + 10))
    with pytest.raises(tinker.RequestFailedError, match=r"sample's result takes \d+ bytes"):
        sample()
    assert used() == held

    tinker_service.cli("tenants", "limits", tenant, "--max-storage-bytes", str(held + 100_000))
    assert len(sample().sequences) == 2
    assert used() > held  # the result kept is counted
    assert "Every tenant's stored bytes match its rows." in tinker_service.cli("storage", "check")
