"""The gateway's real parts: a control plane over HTTP, a CPU engine process, a worker row.

- ``gateway_settings`` (session; SQLite, and PostgreSQL under the ``postgres`` marker):
  provider ``none`` (nothing launches workers), at most ``TENANT_LIMIT`` requests in flight
  per tenant, a route cache that outlives every test (so each test also checks that the
  changes it makes reach the gateway at once).
- ``gateway_plane`` (session): that control plane under uvicorn on a free port (``.url``), its
  app for what a test reads in this process (``.app.state.gateway``) and a session factory on
  its database (``.sessions``).
- ``engine`` (session): ``skytrain engine serve`` with the tiny model, behind a secret
  (``run_engine`` starts another one, for a test of its own).
- ``engine_worker`` (session): a ready worker row pointing at that engine
  (``add_engine_worker`` adds one for any engine). It stands in for the worker agent: the
  gateway reads exactly these columns, and talks to the engine itself.
- ``tenant()``: a new tenant with a key, an ``openai`` client and an httpx client, that can
  create models and place them on a worker.
- ``step1_adapter`` (session): a LoRA adapter for the tiny model made with peft, with random
  (non-zero) weights so that it changes what the model says.
- ``open_stream``: a long stream through the gateway, started and left open.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys
from skytrain_backend.db.models import Checkpoint, Model, Worker, utcnow
from skytrain_backend.protocol import lora_name
from tests.fixtures.ports import free_port
from tests.fixtures.services import MakeSettings, ServedPlane, served_plane
from tests.fixtures.services import serve_in_thread as serve_in_thread

TENANT_LIMIT = 4
# A request for a checkpoint still loading waits this long before its 503.
LOADING_WAIT_S = 3.0
ROUTE_CACHE_TTL_S = 60.0
ENGINE_BASE_MODEL = "tests/tiny-smollm2"
ENGINE_SERVED_NAME = "tiny-base"


def wait_until(condition: Callable[[], bool], *, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.05)


# --- the control plane --------------------------------------------------------------------------


@pytest.fixture(
    scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def gateway_settings(request: pytest.FixtureRequest, make_settings: MakeSettings) -> Settings:
    return make_settings(
        database=request.param,
        tenant_limits={"max_concurrent_requests": TENANT_LIMIT},
        gateway={
            "loading_wait_s": LOADING_WAIT_S,
            # Far longer than any test: every change a test makes must empty the route cache.
            "route_cache_ttl_s": ROUTE_CACHE_TTL_S,
        },
    )


@pytest.fixture(scope="session")
def gateway_plane(gateway_settings: Settings) -> Iterator[ServedPlane]:
    with served_plane(gateway_settings) as plane:
        yield plane


# --- the engine and the worker row standing in for its agent ------------------------------------


@dataclass(frozen=True)
class Engine:
    url: str
    secret: str
    served_name: str
    process: subprocess.Popen[bytes]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=120)


@contextmanager
def run_engine(model_path: Path, log_path: Path, *extra_args: str) -> Iterator[Engine]:
    """``skytrain engine serve`` (the CPU engine) with ``model_path``, as its own process."""
    port = free_port()
    secret = secrets.token_urlsafe(16)
    argv = [sys.executable, "-m", "skytrain_backend", "engine", "serve", "--engine", "hf"]
    argv += ["--model", str(model_path), "--served-model-name", ENGINE_SERVED_NAME]
    argv += ["--port", str(port), "--api-key", secret, *extra_args]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the engine did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.2)
        yield Engine(url=url, secret=secret, served_name=ENGINE_SERVED_NAME, process=process)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def engine(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with run_engine(tiny_model_path, tmp_path_factory.mktemp("engine") / "engine.log") as running:
        yield running


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def add_worker(
    sessions: sessionmaker[Session],
    *,
    base_model: str,
    status: str = "ready",
    engine_endpoint: str | None = None,
    engine_secret: str = "unused",
    served_model_name: str | None = None,
    engine_certificate: str | None = None,
) -> str:
    """A worker row as the worker agent leaves it once registered; returns its id.

    Without ``engine_certificate`` the gateway reaches ``engine_endpoint`` over plain HTTP,
    which it allows on loopback only: a bare engine standing in for a worker's front door.
    """
    with sessions() as session:
        worker = Worker(
            provider="manual",
            base_model=base_model,
            status=status,
            engine_endpoint=engine_endpoint,
            token_hash=secrets.token_hex(32),
            engine_secret=engine_secret,
            engine_certificate=engine_certificate,
            capacity={"max_models": 10_000},
            hardware={"cpu_count": 2},
            served_model_name=served_model_name,
            served=[],
            last_active_at=utcnow(),
        )
        session.add(worker)
        session.commit()
        return worker.id


def add_engine_worker(
    sessions: sessionmaker[Session], engine: Engine, *, base_model: str = ENGINE_BASE_MODEL
) -> str:
    """A ready worker row for ``engine`` (its URL, secret and served name); returns its id."""
    return add_worker(
        sessions,
        base_model=base_model,
        engine_endpoint=engine.url,
        engine_secret=engine.secret,
        served_model_name=engine.served_name,
    )


@pytest.fixture(scope="session")
def engine_worker(gateway_plane: ServedPlane, engine: Engine) -> str:
    return add_engine_worker(gateway_plane.sessions, engine)


def mark_served(
    sessions: sessionmaker[Session], *, worker_id: str, model_id: str, step: int
) -> None:
    """Record that the worker's engine serves ``step`` of the model (the heartbeat does this)."""
    with sessions() as session:
        worker = session.get(Worker, worker_id)
        assert worker is not None
        worker.served = [*worker.served, {"model_id": model_id, "step": step}]
        session.commit()


def add_checkpoint(sessions: sessionmaker[Session], *, model_id: str, step: int) -> None:
    with sessions() as session:
        session.add(Checkpoint(model_id=model_id, step=step, uri=f"file:///checkpoints/{step}"))
        session.commit()


@pytest.fixture(scope="session")
def step1_adapter(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    directory = tmp_path_factory.mktemp("adapter") / "step1"
    get_peft_model(base, config).save_pretrained(directory)
    return directory


def load_adapter(engine: Engine, *, model_id: str, step: int, path: Path) -> str:
    """Load the adapter into the engine under the name the worker agent gives it."""
    name = lora_name(model_id, step)
    response = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    return name


# --- callers ------------------------------------------------------------------------------------


@dataclass
class Tenant:
    name: str
    key: str
    url: str
    sessions: sessionmaker[Session]
    http: httpx.Client
    openai: openai.OpenAI

    def create_model(
        self, *, base_model: str = ENGINE_BASE_MODEL, worker_id: str | None = None
    ) -> dict[str, Any]:
        """A new model (unique name), placed on ``worker_id`` when given."""
        response = self.http.post(
            "/v1/models",
            json={"project": "gw", "name": f"m-{uuid.uuid4().hex[:8]}", "base_model": base_model},
        )
        assert response.status_code == 201, response.text
        model = dict(response.json())
        if worker_id is not None:
            with self.sessions() as session:
                row = session.get(Model, model["id"])
                assert row is not None
                row.worker_id = worker_id
                session.commit()
        return model

    def chat(self, model: str, **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        return self.http.post("/v1/chat/completions", json={**body, **extra})


@pytest.fixture
def tenant(gateway_plane: ServedPlane) -> Iterator[Callable[[], Tenant]]:
    """``tenant()``: a new tenant and its clients (closed after the test)."""
    made: list[Tenant] = []

    def make() -> Tenant:
        name = f"tenant-{uuid.uuid4().hex[:10]}"
        with gateway_plane.sessions() as session:
            _, key = api_keys.create_key(session, tenant_name=name)
        who = Tenant(
            name=name,
            key=key,
            url=gateway_plane.url,
            sessions=gateway_plane.sessions,
            http=httpx.Client(
                base_url=gateway_plane.url, headers={"Authorization": f"Bearer {key}"}, timeout=120
            ),
            openai=openai.OpenAI(base_url=f"{gateway_plane.url}/v1", api_key=key, max_retries=0),
        )
        made.append(who)
        return who

    yield make
    for who in made:
        who.http.close()
        who.openai.close()


class OnEngine(NamedTuple):
    """A new tenant and a model of its own placed on the engine's worker."""

    who: Tenant
    model: dict[str, Any]


@pytest.fixture
def on_engine(tenant: Callable[[], Tenant], engine_worker: str) -> OnEngine:
    alice = tenant()
    return OnEngine(alice, alice.create_model(worker_id=engine_worker))


# Long enough to outlast the test: events with 20 top logprobs fill the socket buffers long
# before 4000 tokens are sampled, so an unread stream stays open.
LONG_STREAM = {
    "messages": [{"role": "user", "content": "Tell a long story."}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "top_logprobs": 20,
    "stream": True,
}


@dataclass
class OpenStream:
    response: httpx.Response
    # Held: dropping a line iterator of an httpx stream closes the stream.
    lines: Iterator[str]


def open_stream(
    stack: ExitStack, who: Tenant, model: str, *, wait_for_a_slot: bool = False
) -> OpenStream:
    """A stream that has started (its first event arrived) and is left open. With
    ``wait_for_a_slot``, a 429 is tried again for a while: a finished request gives its slot
    back just after its answer ends, so the very next request may still find it held."""
    deadline = time.monotonic() + 30
    while True:
        response = stack.enter_context(
            who.http.stream("POST", "/v1/chat/completions", json={**LONG_STREAM, "model": model})
        )
        if response.status_code != 429 or not wait_for_a_slot or time.monotonic() > deadline:
            break
        response.close()
        time.sleep(0.05)
    assert response.status_code == 200
    stream = OpenStream(response, response.iter_lines())
    assert next(stream.lines).startswith("data: ")
    return stream
