"""OpenAI chat completions and completions for the caller's models: the gateway's routes
(``api/gateway/`` does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from skytrain_backend.api.bulk import json_body_doc
from skytrain_backend.api.deps import CredentialsDep, GatewayDep
from skytrain_backend.api.gateway import CHAT, COMPLETIONS
from skytrain_backend.api.schemas import ChatCompletionCreate, CompletionCreate

router = APIRouter(tags=["inference"])


@router.post("/chat/completions", openapi_extra=json_body_doc(ChatCompletionCreate))
async def chat_completions(
    request: Request, credentials: CredentialsDep, gateway: GatewayDep
) -> Response:
    """OpenAI chat completions from one of your models (streamed with ``stream: true``)."""
    return await gateway.forward(request, credentials=credentials, endpoint=CHAT)


@router.post("/completions", openapi_extra=json_body_doc(CompletionCreate))
async def completions(
    request: Request, credentials: CredentialsDep, gateway: GatewayDep
) -> Response:
    """OpenAI (legacy) completions from one of your models."""
    return await gateway.forward(request, credentials=credentials, endpoint=COMPLETIONS)
