"""The Tinker worker protocol is typed: each operation's parameters by its kind (the same
operation the routes queue and the worker leases), the lease's rebuild plan, and what the
worker sends back, refusing shapes it does not know."""

from __future__ import annotations

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from skytrain_backend.db.models import TinkerRequest
from skytrain_backend.errors import SkytrainError
from skytrain_backend.protocol import tinker_ops as wire
from skytrain_backend.scheduler.tinker import worker_ops as runs
from skytrain_backend.worker import client as worker_client

ADAM = {
    "learning_rate": 1e-3,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def _row(kind: str, params: dict[str, object], *, status: str = "running") -> TinkerRequest:
    return TinkerRequest(
        id="req-1", tenant_id="t", run_id="r", seq_id=3, kind=kind, params=params, status=status
    )


def _leased(row: TinkerRequest) -> wire.TinkerOperation:
    leased = runs.operation_for_worker(row)
    assert leased.seq_id == 3 and leased.request_id == "req-1"
    return leased.operation


def test_each_operation_kind_has_its_parameters_typed() -> None:
    optim = _leased(_row("optim_step", {"adam": ADAM}))
    assert isinstance(optim, wire.OptimOperation) and optim.params is not None
    assert optim.params.adam.learning_rate == 1e-3
    load = _leased(
        _row("load_weights", {"path": "tinker://x", "source": {"model_id": "m", "step": 2}})
    )
    assert isinstance(load, wire.LoadOperation) and load.params is not None
    assert load.params.source == wire.CheckpointSource(model_id="m", step=2)
    creation = _leased(_row("create_model", {"kind": "create_model", "seed": 7}))
    assert isinstance(creation, wire.CreationOperation)
    assert creation.params.restore() == wire.RestorePoint(seed=7)
    batch = _leased(_row("forward_backward", {"loss_fn": "ppo"}))
    assert isinstance(batch, wire.BatchOperation) and batch.params.loss_fn == "ppo"


def test_a_refused_operation_reaches_the_worker_finished_and_without_parameters() -> None:
    refused = runs.operation_for_worker(_row("optim_step", {"refused": True}, status="failed"))
    assert isinstance(refused.operation, wire.OptimOperation)
    assert refused.finished and refused.operation.params is None


def test_shapes_the_protocol_does_not_know_are_refused() -> None:
    operation = TypeAdapter(wire.TinkerOperation)
    with pytest.raises(ValidationError, match="kind"):
        operation.validate_python({"kind": "rm -rf", "params": {}})
    with pytest.raises(ValidationError, match="adam"):
        operation.validate_python({"kind": "optim_step", "params": {"lr": 1}})
    with pytest.raises(ValidationError, match=r"result\.metric"):
        wire.OperationCompletion.model_validate({"attempt": 1, "result": {"metric": {}}})
    with pytest.raises(ValidationError, match="next_seq"):
        wire.RebuildPlan.model_validate({"restore": None, "replay": []})


def test_an_answer_in_a_shape_the_worker_does_not_know_names_the_version_problem() -> None:
    request = httpx.Request("POST", "http://control-plane/v1/worker/tinker/runs/j/next")
    answer = {"seq_id": 1, "request_id": "r", "operation": {"kind": "train_harder"}}
    response = httpx.Response(200, json=answer, request=request)
    with pytest.raises(SkytrainError, match="install the control plane's version"):
        worker_client._answer(wire.LeasedOperation, response)
