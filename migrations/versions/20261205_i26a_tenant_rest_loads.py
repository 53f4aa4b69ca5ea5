"""Tenants' REST requests in flight, counted across control-plane processes as their inference
requests are.

Revision ID: i26a
Revises: i26d
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i26a"
down_revision: str | Sequence[str] | None = "i26d"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_loads") as batch:
        batch.add_column(
            sa.Column("rest_requests", sa.BigInteger(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("tenant_loads") as batch:
        batch.alter_column("rest_requests", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("tenant_loads") as batch:
        batch.drop_column("rest_requests")
