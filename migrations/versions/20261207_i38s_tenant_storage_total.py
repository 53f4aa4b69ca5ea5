"""A tenant's stored bytes as a running total on its row (``tenants.storage_bytes``), so the
storage quota is checked by reading one row rather than summing every row the tenant holds
(122-137 ms per write at 100,000 rows, ``bench/quota_cost.py``).

Backfilled from the rows (the sum ``db.tenants.counted_storage`` makes: live checkpoints'
files, logged batches, jobs' inputs, Tinker sessions' metadata and operations' payloads).
Downgrading drops the column.

Revision ID: i38s
Revises: i36a
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38s"
down_revision: str | Sequence[str] | None = "i36a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The sum per tenant, as db.tenants.counted_storage makes it (written out here: a revision
# does not import the models, which move on).
BACKFILL = """
UPDATE tenants SET storage_bytes =
  (SELECT coalesce(sum(c.size_bytes), 0) FROM checkpoints c JOIN models m ON m.id = c.model_id
     WHERE m.tenant_id = tenants.id AND (c.deleted_at IS NULL OR c.purge_pending))
  + (SELECT coalesce(sum(b.size_bytes), 0) FROM trajectory_batches b
       JOIN models m ON m.id = b.model_id WHERE m.tenant_id = tenants.id)
  + (SELECT coalesce(sum(j.input_bytes), 0) FROM training_jobs j
       JOIN models m ON m.id = j.model_id WHERE m.tenant_id = tenants.id)
  + (SELECT coalesce(sum(s.size_bytes), 0) FROM tinker_sessions s
       WHERE s.tenant_id = tenants.id)
  + (SELECT coalesce(sum(r.input_bytes), 0) FROM tinker_requests r
       WHERE r.tenant_id = tenants.id)
"""


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("storage_bytes", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
        )
    op.execute(BACKFILL)
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("storage_bytes", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("storage_bytes")
