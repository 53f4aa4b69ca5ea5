"""The FastAPI application of the control plane: ``create_app(settings)``.

The lifespan opens the database engine and the object store and checks the schema (upgrading
it first when auto-migration is on); the server refuses to start on an outdated schema. The
same routers serve ``/v1`` and ``/v1/preview``, the prefix ART's ``ServerlessBackend`` client
uses, whose request and response shapes are subsets of ours. The web dashboard is served at
``/`` (``skytrain_backend.dashboard``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from sqlalchemy.engine import make_url
from starlette.concurrency import run_in_threadpool

from skytrain_backend import __version__
from skytrain_backend.api.admission import tenant_load
from skytrain_backend.api.admission.auth import AUTH_THREADS, Authenticator
from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.admission.limits import RequestLimits
from skytrain_backend.api.admission.rest_admission import RestAdmission
from skytrain_backend.api.admission.tenant_load import TenantLoads
from skytrain_backend.api.bulk import add_json_body_docs
from skytrain_backend.api.errors import AnswerMiddlewareErrors, install_error_handlers
from skytrain_backend.api.gateway import RESOLVE_CONCURRENCY, Gateway
from skytrain_backend.api.longpoll import CHECK_THREADS, Waiting
from skytrain_backend.api.routes import api_router, health, worker
from skytrain_backend.api.tinker import training, worker_routes
from skytrain_backend.api.tinker.service import LOOKUP_CONCURRENCY, TinkerService
from skytrain_backend.config import Settings, get_settings
from skytrain_backend.dashboard import install_dashboard
from skytrain_backend.db import migrations
from skytrain_backend.db.notify import Notifier
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.json_types import JSONObject
from skytrain_backend.observability import listener, metrics
from skytrain_backend.observability.http import Observe
from skytrain_backend.provision import open_provider
from skytrain_backend.provision.package import WorkerPackage
from skytrain_backend.scheduler.leader import open_leadership
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.storage import open_object_store

# Threads besides the routes' (SKYTRAIN_THREADS) that may each hold a database connection at
# once: the pool opens enough for all of them together.
OWN_DB_THREADS = (
    AUTH_THREADS  # key lookups
    + CHECK_THREADS  # long-polls' checks
    + tenant_load.DB_THREADS  # admission counting: the gateway's
    + tenant_load.REST_COUNTING_TURNS  # and the REST routes'
    + 2  # their releases
    + RESOLVE_CONCURRENCY  # the gateway's routing
    + LOOKUP_CONCURRENCY  # Tinker futures' lookups
    + 2  # the scheduler's pass, and its start and stop
)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.server.threads
        engine = create_db_engine(
            settings.storage.resolved_database_url,
            pool_size=settings.storage.db_pool_size,
            max_connections=settings.server.threads + OWN_DB_THREADS,
        )
        metrics.instrument_engine(engine)
        try:
            await run_in_threadpool(
                migrations.prepare_schema, engine, auto_migrate=settings.storage.should_auto_migrate
            )
            app.state.settings = settings
            app.state.sessionmaker = session_factory(engine)
            app.state.authenticator = Authenticator(
                sessions=app.state.sessionmaker,
                ttl_s=settings.gateway.route_cache_ttl_s,
                failure_ttl_s=settings.admission.auth_failure_cache_ttl_s,
                failures_per_minute=settings.admission.auth_failures_per_minute,
            )
            app.state.rest_loads = TenantLoads(
                sessions=app.state.sessionmaker,
                shared=make_url(settings.storage.resolved_database_url).get_backend_name()
                == "postgresql",
                process_places=settings.admission.rest_admission_process_places,
                counting_turns=tenant_load.REST_COUNTING_TURNS,
            )
            # The routes' threads, taken in turns by tenant (api/admission/fairness.py).
            app.state.route_turns = FairLimiter(
                total=settings.server.threads, per_key=settings.server.threads
            )
            # Worker tokens' requests, counted in this process only.
            app.state.worker_loads = TenantLoads(sessions=app.state.sessionmaker, shared=False)
            # Wakes long-polls (job leases, event followers) when what they wait for commits.
            app.state.notifier = Notifier(settings.storage.resolved_database_url)
            app.state.notifier.install(app.state.sessionmaker)
            await app.state.notifier.start()
            app.state.waiting = Waiting()
            try:
                app.state.store = open_object_store(
                    settings.storage.resolved_object_store_url, settings
                )
                metrics.instrument_store(app.state.store)
                app.state.scheduler = Scheduler(
                    settings=settings,
                    sessions=app.state.sessionmaker,
                    provider=open_provider(settings, app.state.sessionmaker),
                    leadership=open_leadership(settings.storage.resolved_database_url),
                    store=app.state.store,
                )
                app.state.gateway = Gateway(
                    settings=settings,
                    sessions=app.state.sessionmaker,
                    on_unplaced=app.state.scheduler.wake,
                    demand=app.state.scheduler.demand,
                )
                app.state.scheduler.on_worker_gone = app.state.gateway.forget_worker
                app.state.worker_package = WorkerPackage(settings)
                app.state.tinker = TinkerService(
                    settings=settings,
                    sessions=app.state.sessionmaker,
                    store=app.state.store,
                    gateway=app.state.gateway,
                )
                await app.state.scheduler.start()
                try:
                    yield
                finally:
                    await app.state.rest_loads.aclose()
                    await app.state.worker_loads.aclose()
                    await app.state.tinker.aclose()
                    # The gateway's kept-alive connections first: a worker stopped while one
                    # is open waits out its front door's graceful-shutdown timeout for it.
                    await app.state.gateway.aclose()
                    await app.state.scheduler.stop()
            finally:
                await app.state.notifier.stop()
        finally:
            engine.dispose()
            listener.process_ended(settings)

    app = FastAPI(
        title="skytrain",
        version=__version__,
        summary="Train LLM agents with reinforcement learning (GRPO on LoRA).",
        lifespan=lifespan,
    )
    install_error_handlers(app)

    app.add_middleware(RequestLimits, settings=settings)
    # A tenant (or worker token) over its requests is refused before anything else runs...
    app.add_middleware(RestAdmission, settings=settings)
    # What those two raise (the database down) is answered as a route's errors are...
    app.add_middleware(AnswerMiddlewareErrors)
    # ... and outermost, every request gets its id and is counted, refusals included.
    app.add_middleware(Observe)
    app.include_router(health.router)
    app.include_router(api_router, prefix="/v1")
    app.include_router(api_router, prefix="/v1/preview", include_in_schema=False)
    app.include_router(worker.router, prefix="/v1")
    install_dashboard(app)
    app.include_router(worker_routes.router, prefix="/v1")
    # The Tinker protocol, at the paths the official tinker SDK calls.
    app.include_router(training.router)
    _add_json_body_docs(app)
    return app


def _add_json_body_docs(app: FastAPI) -> None:
    """The OpenAPI document, with the bodies the trajectory routes read themselves."""
    generate = app.openapi

    def openapi() -> JSONObject:
        if app.openapi_schema is None:
            add_json_body_docs(generate())
        return generate()

    app.openapi = openapi  # type: ignore[method-assign]
