"""Keyset pagination: ``after=<cursor>&limit=&order=`` -> one page and whether more follow.

Pages are cut on an ordered tuple of columns (``(created_at, id)``, ``(step,)``, ``(id,)``),
so rows inserted while a client pages never shift what it has not read yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from sqlalchemy import Select, tuple_
from sqlalchemy.orm import InstrumentedAttribute, Session

Order = Literal["asc", "desc"]
T = TypeVar("T")


def fetch_page(
    session: Session,
    statement: Select[T],
    *,
    keys: Sequence[InstrumentedAttribute[Any]],
    after: Sequence[Any] | None,
    limit: int,
    order: Order,
) -> tuple[list[T], bool]:
    """Rows of ``statement`` after the cursor ``after`` (values of ``keys``), and has_more."""
    if after is not None:
        # Comparing with a plain tuple binds each value with its column's type.
        cursor = tuple(after)
        position = tuple_(*keys)
        statement = statement.where(position > cursor if order == "asc" else position < cursor)
    ordering = [key.asc() if order == "asc" else key.desc() for key in keys]
    rows = list(session.scalars(statement.order_by(*ordering).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
