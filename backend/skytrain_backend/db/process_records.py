"""The processes control planes started on their hosts (local workers), by host, pid and
start time, with the control plane that owns each.

They let a control plane find what no live control plane owns any more (its owner crashed,
or was stopped without stopping them) and stop it, on its host only, and stop what it owns
itself on shutdown even if it lost track of it in memory. The start times guard against
pids the system has given to other processes since.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from skytrain_backend.child_processes import ProcessIdentity
from skytrain_backend.db.models import ManagedProcess


def record(
    session: Session,
    *,
    kind: str,
    worker_id: str | None,
    host: str,
    process: ProcessIdentity,
    owner: ProcessIdentity,
) -> None:
    session.add(
        ManagedProcess(kind=kind, worker_id=worker_id, host=host, process=process, owner=owner)
    )
    session.commit()


def on_host(session: Session, *, host: str) -> list[ManagedProcess]:
    return list(
        session.scalars(
            select(ManagedProcess).where(ManagedProcess.host == host).order_by(ManagedProcess.id)
        )
    )


def forget(session: Session, *, host: str, process: ProcessIdentity) -> None:
    session.execute(
        delete(ManagedProcess).where(ManagedProcess.host == host, ManagedProcess.process == process)
    )
    session.commit()
