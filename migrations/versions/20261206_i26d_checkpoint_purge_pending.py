"""Checkpoint deletes commit the row first: ``purge_pending`` marks a deleted checkpoint whose
files may still be in the object store (its ``uri`` is cleared with the delete).

A deleted row that still had its ``uri`` (files the store had refused to delete) becomes a
row pending purge. Downgrading drops the mark: files not yet purged then belong to no row,
and the garbage sweep removes them after its grace period.

Revision ID: i26d
Revises: i26c
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i26d"
down_revision: str | Sequence[str] | None = "i26c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(
            sa.Column("purge_pending", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("purge_pending", server_default=None)
    op.execute(
        "UPDATE checkpoints SET purge_pending = true, uri = NULL "
        "WHERE deleted_at IS NOT NULL AND uri IS NOT NULL"
    )


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("purge_pending")
