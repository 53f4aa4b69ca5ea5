"""The ``Gateway``: one per app, the forwarding of a request from caller to engine.

The body goes to the engine of the request's route (``resolver.py``) as the caller sent it,
with these changes: ``model`` becomes the engine's name for the checkpoint, ``max_tokens``
is set when the caller set none (``admission.with_default_max_tokens``), and since every
model here is trainable, the engine is always asked for the sampled tokens' logprobs and their
token ids, and for the prompt's token ids (vLLM's ``return_token_ids``), so the trainer trains
on exactly the tokens the engine saw and never re-tokenizes. ``X-Skytrain-Model-Id``,
``X-Skytrain-Step`` and ``X-Skytrain-Worker`` say what served it. When the caller goes away
while a non-streamed request is still generating, the upstream request is closed at once.
Each request tells the engine whose it is (``TENANT_HEADER``), so an engine shared by several
tenants can take turns between them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission.tenant_load import TenantLoads
from skytrain_backend.api.gateway import admission, answers
from skytrain_backend.api.gateway.admission import COMPLETIONS, Endpoint
from skytrain_backend.api.gateway.balance import Balancer, conversation_of
from skytrain_backend.api.gateway.resolver import Resolver, Routed
from skytrain_backend.api.gateway.upstream import Engines, Upstream
from skytrain_backend.asgi import CLIENT_CLOSED_REQUEST, until_disconnected
from skytrain_backend.config import Settings
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import EngineError, InvalidRequest, Unavailable
from skytrain_backend.observability import gateway as observe
from skytrain_backend.scheduler.demand import DemandMeter
from skytrain_backend.scheduler.routing import EngineRoute


class Gateway:
    """One per app, opened in its lifespan: pooled HTTP clients per worker (pinned to its
    certificate), requests in flight per tenant, and the forwarding of one request."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        on_unplaced: Callable[[], None],
        demand: DemandMeter | None = None,
    ) -> None:
        self.settings = settings
        self.engines = Engines()
        # Which replica each request goes to; its counts are the scheduler's demand.
        self.balancer = Balancer(demand if demand is not None else DemandMeter())
        self.resolver = Resolver(settings=settings, sessions=sessions, on_unplaced=on_unplaced)
        self.loads = TenantLoads(
            sessions=sessions,
            shared=make_url(settings.storage.resolved_database_url).get_backend_name()
            == "postgresql",
        )

    async def aclose(self) -> None:
        await self.loads.aclose()
        await self.engines.aclose()

    def forget_worker(self, worker_id: str) -> None:
        """Close the client of a worker that ended; safe to call from any thread."""
        self.engines.forget_worker(worker_id)

    async def forward(
        self,
        request: Request,
        *,
        credentials: HTTPAuthorizationCredentials | None,
        endpoint: Endpoint,
    ) -> Response:
        """The engine's answer to the caller's request, or the reason there is none."""
        raw = await request.body()
        routed = await self.resolver.route(credentials=credentials, raw=raw, endpoint=endpoint)
        observe.note_routed(routed.tenant_id, routed.route, endpoint.path)
        release = await self.loads.admit(routed.tenant_id, limits=routed.limits, cost=routed.cost)
        counted: list[Callable[[], None]] = [release]

        def count_out() -> None:
            for done in counted:
                done()

        try:
            response = await self._proxy(request, routed=routed, endpoint=endpoint, counted=counted)
        except BaseException:
            count_out()
            raise
        if isinstance(response, answers.EventStream):
            response.on_close = count_out  # a stream counts itself out when it ends
        else:
            count_out()
        return response

    async def _send(
        self,
        route: EngineRoute,
        *,
        path: str,
        body: dict[str, Any],
        tenant_id: str,
        conversation: str | None,
        counted: list[Callable[[], None]],
    ) -> tuple[Upstream, EngineRoute]:
        """The answer of one of the route's replicas (``balance.py``), and which it was; a
        replica that cannot be reached, or whose engine refuses to take the request (503:
        going to sleep for a job the control plane has not heard of yet, restarting), is left
        out and the next one tried. The replica's request is counted out by the caller
        (``counted``)."""
        tried: set[str] = set()
        while True:
            chosen = self.balancer.pick(
                route, tenant_id=tenant_id, conversation=conversation, exclude=tried
            )
            assert chosen is not None  # the route's own engine at least, before any is tried
            done = self.balancer.begin(chosen)
            sent = {**body, "model": chosen.engine_model}
            try:
                upstream = await self.engines.send(
                    route=chosen, path=path, body=sent, tenant_id=tenant_id
                )
            except Unavailable:
                # Not reached (its connection failed): another replica, if one is left.
                done()
                if not self._leave_out(chosen, tried, route):
                    raise
                continue
            except BaseException:
                done()
                raise
            # A 503 comes before the engine generates anything (a stream's status is 200):
            # the request is another replica's to answer, if one is left.
            if upstream.status_code == 503 and len(tried) + 1 < len(route.choices):
                upstream.close()
                done()
                self._leave_out(chosen, tried, route)
                continue
            counted.append(done)
            return upstream, chosen

    def _leave_out(self, chosen: EngineRoute, tried: set[str], route: EngineRoute) -> bool:
        """Leave a replica that could not take a request out; whether another is left."""
        tried.add(chosen.worker_id)
        self.balancer.unreachable(chosen.worker_id)
        if len(tried) >= len(route.choices):
            return False
        observe.metrics.replica_retried()
        return True

    async def _proxy(
        self,
        request: Request,
        *,
        routed: Routed,
        endpoint: Endpoint,
        counted: list[Callable[[], None]],
    ) -> Response:
        body = routed.body
        upstream_body = dict(body)
        endpoint.ask_for_logprobs(upstream_body)
        admission.with_default_max_tokens(
            upstream_body, default_max_tokens=self.settings.gateway.default_max_tokens
        )
        stream = bool(body.get("stream"))
        conversation = conversation_of(body, dict(request.headers))
        chosen: list[EngineRoute] = []

        async def exchange() -> tuple[Upstream, Any]:
            # The engine's answer, read whole (parsed) unless it streams or refused: one
            # watch for the caller leaving covers the request and the answer.
            upstream, route = await self._send(
                routed.route,
                path=endpoint.path,
                body=upstream_body,
                tenant_id=routed.tenant_id,
                conversation=conversation,
                counted=counted,
            )
            chosen.append(route)
            if stream or upstream.status_code != 200:
                return upstream, None
            return upstream, await answers.read_json(upstream, route=route)

        exchanged = await until_disconnected(request.receive, exchange())
        if exchanged is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        upstream, content = exchanged
        route = chosen[0]
        headers = {
            "X-Skytrain-Model-Id": route.model_id,
            "X-Skytrain-Step": str(route.step),
            "X-Skytrain-Worker": route.worker_id,
        }
        if upstream.status_code != 200:
            return await answers.refusal(upstream, route=route)
        if stream:
            return answers.EventStream(
                upstream, model=body["model"], step=route.step, headers=headers
            )
        return answers.json_answer(content, model=body["model"], step=route.step, headers=headers)

    async def admit_completion(
        self, *, tenant_id: str, limits: TenantLimits, body: dict[str, Any]
    ) -> Callable[[], None]:
        """Count a ``/v1/completions`` request of the tenant's in, as ``forward`` counts the
        requests it routes (400 if it could never fit its limits, 429 while it does not fit
        now); the function that counts it out. The Tinker protocol's samples are counted from
        the moment they are accepted, so those waiting for their model count too."""
        cost = admission.cost(
            body,
            size=len(json.dumps(body)),
            default_max_tokens=self.settings.gateway.default_max_tokens,
        )
        admission.check_fits(limits, cost)
        return await self.loads.admit(tenant_id, limits=limits, cost=cost)

    async def complete_tokens(
        self, *, tenant_id: str, model: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """A non-streamed ``/v1/completions`` answer for the tenant's ``model`` (a checkpoint
        being loaded is waited for, as for ``forward``), admitted already
        (``admit_completion``). The Tinker protocol's sampling calls it; an engine's refusal
        raises ``InvalidRequest``."""
        resolved = await self.resolver.route_of_tenant(tenant_id=tenant_id, model=model)
        upstream_body = dict(body)
        COMPLETIONS.ask_for_logprobs(upstream_body)
        admission.with_default_max_tokens(
            upstream_body, default_max_tokens=self.settings.gateway.default_max_tokens
        )
        counted: list[Callable[[], None]] = []
        try:
            upstream, route = await self._send(
                resolved,
                path=COMPLETIONS.path,
                body=upstream_body,
                tenant_id=tenant_id,
                conversation=None,
                counted=counted,
            )
            if upstream.status_code != 200:
                await answers.refusal(upstream, route=route)  # raises unless it was refused
                raise InvalidRequest(
                    f"the engine refused the request: {answers.engine_message(upstream)}"
                )
            content = await answers.read_json(upstream, route=route)
        finally:
            for done in counted:
                done()
        if not isinstance(content, dict):
            raise EngineError(f"the engine of worker {route.worker_id} answered no JSON object")
        return content
