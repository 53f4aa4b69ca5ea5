"""Uploaded SFT files as rows (``uploaded_files``), so their bytes count in the tenant's
storage quota (``tenants.storage_bytes``) and a tenant can list and delete them.

Files uploaded before this revision have no row: they stay readable by their URI, uncounted
(their size is not known without reading the store) and cannot be listed. Downgrading drops
the table and takes the files' bytes off their tenants' totals.

Revision ID: i38u
Revises: i35a
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38u"
down_revision: str | Sequence[str] | None = "i35a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "uploaded_files",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("num_trajectories", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_uploaded_files_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_uploaded_files")),
    )
    op.create_index(
        op.f("ix_uploaded_files_tenant_id_created_at_id"),
        "uploaded_files",
        ["tenant_id", "created_at", "id"],
    )


def downgrade() -> None:
    op.execute(
        "UPDATE tenants SET storage_bytes = storage_bytes - (SELECT coalesce(sum(f.size_bytes), "
        "0) FROM uploaded_files f WHERE f.tenant_id = tenants.id)"
    )
    op.drop_index(op.f("ix_uploaded_files_tenant_id_created_at_id"), table_name="uploaded_files")
    op.drop_table("uploaded_files")
