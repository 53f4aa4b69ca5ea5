"""Bytes reserved by uploads in flight (``upload_reservations``): an upload takes its bytes of
its tenant's storage quota as it streams, before they reach the store, and gives them back at
its commit or failure. Each reservation expires: one a control plane could not give back (it
died mid-upload, or lost its database) stops counting once it has expired.

Revision ID: i38w
Revises: i35b
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38w"
down_revision: str | Sequence[str] | None = "i35b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "upload_reservations",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_upload_reservations_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upload_reservations")),
    )
    op.create_index(
        op.f("ix_upload_reservations_tenant_id"), "upload_reservations", ["tenant_id"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_upload_reservations_tenant_id"), table_name="upload_reservations")
    op.drop_table("upload_reservations")
