"""The CPU engine's HTTP server: the same routes, bodies and errors as ``vllm serve``.

Errors are vLLM's JSON (``{"error": {"message", "type", "param", "code"}}``) with the status of
the skytrain error behind them: 400 for a malformed request or a bad adapter path, 404 for an
unknown model or adapter, 503 while the engine sleeps. A failed request changes nothing: the
engine keeps serving. With an API key, every route but ``/health`` requires ``Authorization:
Bearer <key>``: the ``/v1`` routes, and the control routes (``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/control_log``), which vLLM leaves open and skytrain keeps to its worker.
``/control_log`` (skytrain's own) lists the control calls the engine carried out, with their
times: what the worker's job timeline reports. The gateway's
``X-Skytrain-Tenant`` header says whose turn a request takes in the batch.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from skytrain_backend.asgi import CLIENT_CLOSED_REQUEST, until_disconnected
from skytrain_backend.config import get_settings
from skytrain_backend.engine.hf.engine import HFEngine, SleepMode
from skytrain_backend.engine.hf.openai_api import OpenAIServing, error_response
from skytrain_backend.engine.options import EngineOptions
from skytrain_backend.engine.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    ControlCall,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from skytrain_backend.errors import (
    AuthenticationFailed,
    EngineError,
    InvalidRequest,
    SkytrainError,
)
from skytrain_backend.observability.http import Observe
from skytrain_backend.observability.logs import configure_logging
from skytrain_backend.protocol import TENANT_HEADER

logger = logging.getLogger(__name__)


def _serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.serving
    return serving


def _check_api_key(request: Request) -> None:
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), expected.encode()):
        raise AuthenticationFailed(
            "missing or wrong API key: send the engine's key as 'Authorization: Bearer <key>'"
        )


ServingDep = Annotated[OpenAIServing, Depends(_serving)]

router = APIRouter()
control = APIRouter(dependencies=[Depends(_check_api_key)])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@control.post("/sleep")
async def sleep(
    serving: ServingDep,
    level: Annotated[int, Query(ge=0, le=2)] = 1,
    mode: SleepMode = "abort",
) -> dict[str, str | int]:
    await serving.engine.sleep(mode)
    return {"status": "sleeping", "level": level}


@control.post("/wake_up")
async def wake_up(serving: ServingDep) -> dict[str, str]:
    await serving.engine.wake_up()
    return {"status": "awake"}


@control.get("/is_sleeping")
async def is_sleeping(serving: ServingDep) -> dict[str, bool]:
    return {"is_sleeping": serving.engine.is_sleeping}


@control.get("/control_log")
async def control_log(serving: ServingDep) -> dict[str, list[ControlCall]]:
    return {"data": list(serving.engine.control_log)}


@v1.get("/models")
async def models(serving: ServingDep) -> ModelList:
    return serving.models()


@v1.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, serving: ServingDep, request: Request
) -> Response:
    tenant = request.headers.get(TENANT_HEADER)
    return await _unless_abandoned(request, serving.chat(body, tenant=tenant))


@v1.post("/completions")
async def completions(body: CompletionRequest, serving: ServingDep, request: Request) -> Response:
    tenant = request.headers.get(TENANT_HEADER)
    return await _unless_abandoned(request, serving.completion(body, tenant=tenant))


async def _unless_abandoned(request: Request, work: Awaitable[Any]) -> Response:
    """The response to ``work``; if the client hangs up first, its generation is aborted.

    A stream stops when its client goes away (the response's iterator is closed); a
    non-streamed answer is computed in full before its first byte, so the disconnect is
    watched for here and the generation cancelled, freeing its place in the batch (vLLM
    aborts such requests too).
    """
    result = await until_disconnected(request.receive, work)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return _respond(result)


@v1.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, serving: ServingDep) -> Response:
    await serving.engine.load_adapter(body.lora_name, body.lora_path, replace=body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@v1.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, serving: ServingDep) -> Response:
    await serving.engine.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _respond(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.to_json())


def _error(error: SkytrainError) -> JSONResponse:
    return JSONResponse(error_response(error).to_json(), status_code=error.status_code)


async def _skytrain_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SkytrainError)
    return _error(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for item in exc.errors():
        location = ".".join(str(part) for part in item["loc"][1:]) or "body"
        problems.append(f"{location}: {item['msg']}")
    return _error(InvalidRequest("; ".join(problems)))


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed", exc_info=exc)
    return _error(EngineError(f"the engine failed on this request: {exc}"))


def create_app(engine: HFEngine, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app of a running engine; closing the app stops the engine thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()

    app = FastAPI(title="skytrain engine", lifespan=lifespan)
    app.state.serving = OpenAIServing(engine)
    app.state.api_key = api_key
    app.include_router(router)
    app.include_router(control)
    app.include_router(v1)
    app.add_exception_handler(SkytrainError, _skytrain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


def default_threads() -> int:
    """Half the cores: the engine shares its machine with the trainer (and, on a workstation,
    everything else). A CPU engine whose threads outnumber free cores loses most of its speed:
    every operator waits for its slowest, descheduled thread."""
    return max(1, (os.cpu_count() or 2) // 2)


def serve(options: EngineOptions, *, log_level: str = "info") -> None:
    """Load ``options.model`` (a Hugging Face id or a directory) and serve it until
    interrupted; of the options, the CPU engine takes all but the vLLM-only ones."""
    import torch
    import uvicorn

    from skytrain_backend.hub import resolve_model

    torch.set_num_threads(options.threads or default_threads())
    settings = get_settings()
    configure_logging(
        settings.observability.log_format,
        level=log_level.upper(),
        whole_process=True,
        worker_id=settings.worker.id,
    )
    engine = HFEngine(
        resolve_model(options.model),
        served_model_name=options.name,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs or 32,
        dtype=options.dtype,
        max_lora_rank=options.max_lora_rank,
    )
    # Each request's line carries the id the gateway gave it (passed on by the front door).
    app = Observe(create_app(engine, api_key=options.api_key), count=False)
    uvicorn.run(
        app,
        host=options.host,
        port=options.port,
        log_level=log_level,
        log_config=None,
        access_log=False,
    )
