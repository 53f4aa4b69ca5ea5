"""Tenants' inference requests in flight per control-plane process (limits counted across
processes on PostgreSQL).

Revision ID: i16b
Revises: i13b
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i16b"
down_revision: str | Sequence[str] | None = "i13b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenant_loads",
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("holder", ID, nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("sequences", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_loads_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "holder", name=op.f("pk_tenant_loads")),
    )


def downgrade() -> None:
    op.drop_table("tenant_loads")
