"""The gateway's balancer (``api/gateway/balance.py``) on its own: which replica a request
goes to. Routes are built as ``scheduler.routing`` builds them; nothing is sent anywhere."""

from __future__ import annotations

import pytest

from skytrain_backend.api.gateway import balance
from skytrain_backend.api.gateway.balance import Balancer
from skytrain_backend.scheduler.demand import DemandMeter
from skytrain_backend.scheduler.routing import EngineRoute


def _route(model_id: str, workers: tuple[str, ...]) -> EngineRoute:
    """A route to the model's step 1 on each of ``workers``."""

    def on(worker_id: str) -> EngineRoute:
        return EngineRoute(
            model_id=model_id,
            step=1,
            worker_id=worker_id,
            engine_endpoint=f"http://127.0.0.1:9/{worker_id}",
            engine_secret="s",
            engine_certificate=None,
            engine_model=f"{model_id}@1",
        )

    replicas = tuple(on(worker_id) for worker_id in workers)
    return EngineRoute(**{**replicas[0].__dict__, "replicas": replicas})


def test_one_tenants_many_conversations_never_evict_another_tenants_affinity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35: conversation affinity was one LRU for every tenant, so a tenant sending many
    distinct ``user`` values evicted every other tenant's conversations (their next turn lost
    its replica's prefix cache). Each tenant's entries now evict only its own."""
    monkeypatch.setattr(balance, "AFFINITY_ENTRIES_PER_TENANT", 8)
    balancer = Balancer(DemandMeter())
    workers = ("w1", "w2", "w3")
    alice, bob = _route("model-a", workers), _route("model-b", workers)
    kept = balancer.pick(alice, tenant_id="alice", conversation="u:chat-1")
    first = balancer.pick(bob, tenant_id="bob", conversation="u:bot-0")
    assert kept is not None and first is not None
    # Both replicas are now busy: a request with no affinity goes to an idle one.
    ends = [balancer.begin(_route("other", (w,))) for w in (kept.worker_id, first.worker_id)]
    for user in range(1, 50):
        balancer.pick(bob, tenant_id="bob", conversation=f"u:bot-{user}")
        ends.append(balancer.begin(_route("other", (first.worker_id,))))  # stays the busiest
    again = balancer.pick(alice, tenant_id="alice", conversation="u:chat-1")
    assert again is not None and again.worker_id == kept.worker_id
    # A tenant's own conversations do evict its oldest: Bob's first is forgotten, and placed
    # as any request, away from its busy replica.
    forgotten = balancer.pick(bob, tenant_id="bob", conversation="u:bot-0")
    assert forgotten is not None and forgotten.worker_id != first.worker_id
    recent = balancer.pick(bob, tenant_id="bob", conversation="u:bot-49")
    remembered = balancer.pick(bob, tenant_id="bob", conversation="u:bot-49")
    assert recent is not None and remembered is not None
    assert remembered.worker_id == recent.worker_id
    for end in ends:
        end()
