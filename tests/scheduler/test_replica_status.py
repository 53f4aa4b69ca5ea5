"""What a model's replicas say they can do (``scheduler.replicas.placed_on``: what
``GET /v1/models/{id}``, ``skytrain models show`` and the dashboard show): each as its
worker is now, not as its row was written."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import ModelReplica, Worker
from skytrain_backend.scheduler import replicas
from tests.fixtures.rows import add_model, add_ready_worker

# The worker's status -> what its replica of the model says.
SAYS = {
    "ready": "serving",
    "training": "serving",
    "sleeping": "sleeping",
    "provisioning": "starting",
    "starting": "starting",
    "unreachable": "unreachable",
    "draining": "draining",
    "lost": "unreachable",
}


def test_each_replica_says_what_its_worker_can_do_now(db_sessions: sessionmaker[Session]) -> None:
    base = "tests/replica-status"
    with db_sessions() as session:
        model = add_model(session, "status", base_model=base)
        home = add_ready_worker(session, base_model=base)
        model.worker_id = home.id
        workers = {status: add_ready_worker(session, base_model=base) for status in SAYS}
        for status, worker in workers.items():
            worker.status = status
            session.add(ModelReplica(model_id=model.id, worker_id=worker.id, status="serving"))
        drained = add_ready_worker(session, base_model=base)
        session.add(ModelReplica(model_id=model.id, worker_id=drained.id, status="draining"))
        session.commit()

        placed = {item.worker_id: item for item in replicas.placed_on(session, model=model)}
        assert (placed[home.id].role, placed[home.id].status) == ("home", "serving")
        for status, worker in workers.items():
            assert placed[worker.id].status == SAYS[status], status
        # A replica being drained says so even on a ready worker.
        assert placed[drained.id].status == "draining"

        # The home follows its worker too: asleep while it trains.
        session.get_one(Worker, home.id).status = "sleeping"
        session.commit()
        (first, *_) = replicas.placed_on(session, model=model)
        assert (first.worker_id, first.status) == (home.id, "sleeping")
