"""Keyset pagination: ``after=<cursor>&limit=&order=`` -> one page and whether more follow.

Pages are cut on an ordered tuple of columns (``(created_at, id)``, ``(step,)``, ``(id,)``),
so rows inserted while a client pages never shift what it has not read yet. A listing route
takes a ``PageRequest`` (the id of the last row seen, the size, the order) and its query
function hands it to ``list_page`` with the statement and how to find that row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from sqlalchemy import Executable, Select, tuple_
from sqlalchemy.orm import InstrumentedAttribute, Session

from skytrain_backend.errors import InvalidRequest

Order = Literal["asc", "desc"]
T = TypeVar("T")


@dataclass(frozen=True)
class PageRequest:
    """One page asked for: ``limit`` rows after the row whose id is ``after`` (from the start
    when None), in ``order``."""

    after: str | None = None
    limit: int = 20
    order: Order = "asc"


def where_given(statement: Select[T], *matches: tuple[Any, object]) -> Select[T]:
    """``statement`` keeping the rows whose column equals each ``(column, value)`` given: a
    listing's optional filters, where a value None filters nothing."""
    for column, value in matches:
        if value is not None:
            statement = statement.where(column == value)
    return statement


def list_page(
    session: Session,
    statement: Select[T],
    *,
    keys: Sequence[InstrumentedAttribute[Any]],
    page: PageRequest,
    anchor: Executable,
    missing: str,
) -> tuple[list[T], bool]:
    """A page of ``statement`` cut on ``keys``, and has_more. ``anchor`` selects the ``keys``
    of the row ``page.after`` names, among the rows the caller may see; an id it does not find
    is an ``InvalidRequest`` saying it is not ``missing``."""
    cursor = None
    if page.after is not None:
        row = session.execute(anchor).first()
        if row is None:
            raise InvalidRequest(f"after={page.after!r} is not {missing}")
        cursor = tuple(row)
    return fetch_page(
        session, statement, keys=keys, after=cursor, limit=page.limit, order=page.order
    )


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
