"""Storage quotas: the bytes each row holds in the store or the database, so a tenant's usage is
the sum over its rows (``db.tenants.storage_used``) and falls when rows are deleted.

``trajectory_batches.size_bytes`` (a logged batch's object), ``training_jobs.input_bytes`` (a
job's input batch), ``tinker_sessions.size_bytes`` (its ``user_metadata``) and
``tinker_requests.input_bytes`` (a queued operation's payload). Rows written before this
revision count 0: their size is not known without reading every object.

Revision ID: i38q
Revises: i38a
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38q"
down_revision: str | Sequence[str] | None = "i38a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("trajectory_batches", "size_bytes"),
    ("training_jobs", "input_bytes"),
    ("tinker_sessions", "size_bytes"),
    ("tinker_requests", "input_bytes"),
)


def upgrade() -> None:
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column(column, sa.BigInteger(), nullable=False, server_default=sa.text("0"))
            )
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, server_default=None)


def downgrade() -> None:
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column(column)
