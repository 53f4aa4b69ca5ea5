"""A property-based fuzzer over the OpenAPI document: no request a client can send gets a 5xx.

schemathesis reads ``/openapi.json`` from the real control plane (on both databases) and, for
every operation, sends requests that fit the schema and requests that do not (wrong types,
values outside the stated ranges, missing fields), as a seeded tenant that owns a model with
a logged batch, a queued job and a checkpoint. Each generated request is sent twice: as
generated (random ids: the checks and lookups that refuse them) and with the tenant's own ids
in its path and body (so the query and body reach the work behind them).

An answer fails the test if it is a 5xx, or if it shows a stack trace or a path of the host.
The one 5xx that is right here is an inference request's 503 with ``Retry-After``: no worker
serves the seeded model (the provider is ``none``). The number of examples per operation is
bounded (``FUZZ_EXAMPLES``): a minute or two per database on a quiet 2-core machine, more
under load, so the test is ``slow``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.storage import ObjectStore
from tests.api.support import add_checkpoint, group, sft_trajectory
from tests.fixtures.services import ApiKey, ControlPlane

FUZZ_EXAMPLES = 8
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")
# What an answer must never show a tenant: Python's traces, and where things live on the host.
LEAKS = re.compile(r"Traceback \(most recent call|File \"/|/tmp/|/home/|/root/|/srv/|site-packages")


@dataclass(frozen=True)
class Seeded:
    key: ApiKey
    ids: dict[str, str]


@pytest.fixture
def seeded(
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> Seeded:
    """A tenant with a model, a logged batch, a queued job, a checkpoint and an uploaded file."""
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as http:
        model = http.post(
            "/v1/models", json={"project": "fuzz", "name": "seeded", "base_model": "tiny/llama"}
        ).json()
        batch = http.post(
            f"/v1/models/{model['id']}/log", json={"trajectory_groups": [group()]}
        ).json()
        job = http.post(
            "/v1/training-jobs", json={"model_id": model["id"], "trajectory_groups": [group()]}
        ).json()
        upload = http.post(
            "/v1/files",
            files={"file": ("d.jsonl", json.dumps(sft_trajectory()).encode() + b"\n")},
        ).json()
    add_checkpoint(
        db_sessions,
        object_store,
        tenant_id=key.tenant_id,
        model_id=model["id"],
        step=1,
        files={"adapter_config.json": b"{}"},
    )
    return Seeded(
        key=key,
        ids={
            "model_id": model["id"],
            "batch_id": batch["id"],
            "job_id": job["id"],
            "file_uri": upload["uri"],
        },
    )


@pytest.fixture
def openapi(control_plane: ControlPlane) -> schemathesis.BaseSchema:
    """The control plane's own /openapi.json, with generation kept cheap: values a schema
    leaves free (trajectory metadata, tools) are generated as scalars, and lists and free-form
    objects hold at most 3 items. What the server does with them does not depend on their
    depth; generating deep arbitrary JSON took minutes per operation."""
    document = httpx.get(f"{control_plane.url}/openapi.json", timeout=60).json()
    _bound(document)
    config = schemathesis.Config.from_dict({"generation": {"max-examples": FUZZ_EXAMPLES}})
    return schemathesis.openapi.from_dict(document, config=config)


SCALAR = {"type": ["string", "number", "boolean", "null"]}


def _bound(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _bound(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in list(node.items()):
        if key in ("items", "additionalProperties") and value in ({}, True):
            node[key] = SCALAR
        else:
            _bound(value)
    if node.get("type") == "array":
        node.setdefault("maxItems", 3)
    if node.get("type") == "object" and "properties" not in node:
        node.setdefault("maxProperties", 3)


def _with_seeded_ids(case: Case, seeded: Seeded) -> Case | None:
    """The same request about the tenant's own resources (None: it would destroy them)."""
    if case.method.upper() == "DELETE" and case.path == "/v1/models/{model_id}":
        return None
    path_parameters = {
        name: seeded.ids.get(name, value) for name, value in (case.path_parameters or {}).items()
    }
    body = case.body
    if isinstance(body, dict):
        body = dict(body)
        if "model_id" in body:
            body["model_id"] = seeded.ids["model_id"]
        if "training_data_url" in body:
            body["training_data_url"] = seeded.ids["file_uri"]
    return case.operation.Case(
        path_parameters=path_parameters,
        query=case.query,
        headers=case.headers,
        body=body,
        media_type=case.media_type,
    )


def _check(case: Case, response: Any) -> None:
    text = response.text
    body = json.dumps(case.body, default=repr)[:300] if isinstance(case.body, dict | list) else ""
    where = (
        f"{case.method.upper()} {case.formatted_path} {case.query} {body} -> {response.status_code}"
    )
    assert not LEAKS.search(text), f"{where} shows the host: {text[:500]}"
    if response.status_code < 500:
        return
    if case.path in INFERENCE_PATHS and response.status_code == 503:
        assert response.headers.get("Retry-After"), where
        return
    pytest.fail(f"{where}: {text[:500]}")


# Minutes on 2 cores (schemathesis sends hundreds of requests per database): `slow`. The
# ranges and refusals it sweeps have tests of their own in the fast suite
# (tests/hostile/test_ranges.py on both databases, tests/api/test_validation.py).
@pytest.mark.slow
def test_no_request_gets_a_5xx_or_shows_the_host(
    openapi: schemathesis.BaseSchema, seeded: Seeded, control_plane: ControlPlane
) -> None:
    headers = seeded.key.headers
    operations = [result.ok() for result in openapi.get_all_operations()]
    assert len(operations) >= 20, [operation.label for operation in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def send(case: Case) -> None:
                for sent in (case, _with_seeded_ids(case, seeded)):
                    if sent is None:
                        continue
                    sent_headers = {**(sent.headers or {}), **headers}
                    response = sent.call(
                        base_url=control_plane.url, headers=sent_headers, timeout=60
                    )
                    _check(sent, response)

            try:
                send()
            except Unsatisfiable:
                # Nothing in this operation can be made invalid (GET /health).
                assert mode is GenerationMode.NEGATIVE, operation.label
