"""Tenant limits set by the operator, and the processes control planes started on their hosts.

Revision ID: i13b
Revises: i15
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "i13b"
down_revision: str | Sequence[str] | None = "i15"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)
NAME = sa.String(length=128)
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("limits", JSON, nullable=False, server_default=sa.text("'{}'"))
        )
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("limits", server_default=None)
    op.create_table(
        "processes",
        sa.Column("id", ID, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("worker_id", ID, nullable=True),
        sa.Column("host", NAME, nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("start_time", sa.Float(), nullable=False),
        sa.Column("owner_pid", sa.Integer(), nullable=False),
        sa.Column("owner_start_time", sa.Float(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_processes")),
    )
    op.create_index(op.f("ix_processes_host"), "processes", ["host"])


def downgrade() -> None:
    op.drop_index(op.f("ix_processes_host"), table_name="processes")
    op.drop_table("processes")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("limits")
