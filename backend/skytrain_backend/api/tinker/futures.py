"""The Tinker protocol's futures: ``retrieve_future`` answers a finished operation or sample
(protobuf for forward-backward and sampling), its failure, or ``try_again``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from skytrain_backend.api.admission.rest_admission import parked
from skytrain_backend.api.deps import (
    SessionDep,
    SessionRoute,
    SettingsDep,
    StoreDep,
    TinkerTenantDep,
    WaitingDep,
)
from skytrain_backend.api.tinker.deps import TinkerDep
from skytrain_backend.api.tinker.service import RETRIEVE_WAIT_S
from skytrain_backend.db import tenants
from skytrain_backend.db.models import (
    TinkerRequest,
    TinkerRun,
)
from skytrain_backend.errors import RateLimited
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.protocol import tinker_protobuf
from skytrain_backend.scheduler.tinker import futures, runs

# Included by the main Tinker router (api/tinker/training.py), under its /api/v1 prefix.
router = APIRouter(tags=["tinker"], route_class=SessionRoute)


def _pairs_rows(rows: list[Any] | None) -> list[tinker_protobuf.TopLogprobs] | None:
    """Top-k rows read back from JSON (pairs stored as lists)."""
    if rows is None:
        return None
    return [None if row is None else [(int(t), float(v)) for t, v in row] for row in rows]


def _result(store: Any, session: Session, row: TinkerRequest) -> Response:
    """A succeeded future's answer: protobuf for forward-backward and sampling."""
    if row.kind in ("forward", "forward_backward"):
        assert row.result_uri is not None and row.run_id is not None
        run = session.get_one(TinkerRun, row.run_id)
        assert row.seq_id is not None
        key = runs.output_key(run, row.seq_id)
        session.commit()  # no transaction open while the store reads
        content = store.get_bytes(key)
        return Response(content, media_type=tinker_protobuf.PROTOBUF_MEDIA_TYPE)
    if row.kind == "sample":
        result = row.result or {}
        sequences = [
            tinker_protobuf.SampledSequence(
                s["tokens"], s["logprobs"], s["stop_reason"], _pairs_rows(s.get("topk"))
            )
            for s in result["sequences"]
        ]
        scored = result.get("prompt")
        prompt = (
            tinker_protobuf.PromptScores(scored["logprobs"], _pairs_rows(scored["topk"]))
            if scored is not None
            else None
        )
        content = tinker_protobuf.encode_sample_response(sequences, prompt)
        return Response(content, media_type=tinker_protobuf.PROTOBUF_MEDIA_TYPE)
    return JSONResponse(row.result or {})


@router.post("/retrieve_future")
async def retrieve_future(
    request: Request,
    body: schemas.FutureRetrieveRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
    tinker: TinkerDep,
    waiting: WaitingDep,
    store: StoreDep,
) -> Response:
    """The future's answer; one not done yet is waited on for a while (holding no database
    connection), then answered ``try_again`` with why it waits. Past the tenant's
    ``max_waiting_polls`` waits, a future not done yet is answered 429 at once."""
    tenant_id = tenant.id
    wait_limit = tenants.limits_of(tenant, settings).max_waiting_polls
    session.rollback()
    with waiting.hold(tenant_id, limit=wait_limit) as may_wait:
        answer = await tinker.wait(
            tenant_id=tenant_id,
            request_id=body.request_id,
            on_done=lambda session, row: _result(store, session, row),
            wait_s=RETRIEVE_WAIT_S if may_wait else 0.0,
            idle=lambda: parked(request.scope),
        )
    if isinstance(answer, Response):
        return answer
    if isinstance(answer, futures.Failed):
        failed = schemas.RequestFailedResponse(error=answer.error, category=answer.category)
        return JSONResponse(failed.model_dump())
    if not may_wait:
        raise RateLimited(
            f"{wait_limit} futures of yours are being waited on already (max_waiting_polls): "
            "ask again shortly, or wait on fewer futures at once",
            retry_after_s=1.0,
        )
    pending = schemas.TryAgainResponse(
        request_id=body.request_id, queue_state=answer.queue_state, queue_state_reason=answer.reason
    )
    return JSONResponse(pending.model_dump())


@router.post("/cancel_future", status_code=204)
def cancel_future(tenant: TinkerTenantDep) -> None:
    """Accepted and ignored: a sample runs to its end (the SDK sends this only when the
    server's dynamic config enables it, which skytrain's does not)."""
