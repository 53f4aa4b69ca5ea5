"""A tenant's stored bytes as a running total on its row (``tenants.storage_bytes``), so the
storage quota is checked by reading one row rather than summing every row the tenant holds
(122-137 ms per write at 100,000 rows, ``bench/quota_cost.py``).

Backfilled from the rows (the sum ``db.tenants.counted_storage`` makes: live checkpoints'
files, logged batches, jobs' inputs, Tinker sessions' metadata and operations' payloads).
``tinker_requests.output_bytes``: a Tinker operation's output object, counted from now on (0
for older rows: their size is not known without listing the store). Downgrading drops both.

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
  + (SELECT coalesce(sum(r.input_bytes + r.output_bytes), 0) FROM tinker_requests r
       WHERE r.tenant_id = tenants.id)
"""


def upgrade() -> None:
    # Plain ADD COLUMN, never SQLite's batch copy of the table: dropping the old ``tenants``
    # would cascade (PRAGMA foreign_keys is on) to every row that refers to a tenant. The
    # server default stays on SQLite (removing it needs that copy); the models never rely on it.
    sqlite = op.get_bind().dialect.name == "sqlite"
    for table, column in (("tinker_requests", "output_bytes"), ("tenants", "storage_bytes")):
        op.add_column(
            table,
            sa.Column(column, sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        )
    op.execute(BACKFILL)
    if not sqlite:
        for table, column in (("tinker_requests", "output_bytes"), ("tenants", "storage_bytes")):
            op.alter_column(table, column, server_default=None)


def downgrade() -> None:
    # SQLite 3.35+ drops a column in place (no copy of the table, so nothing cascades).
    op.drop_column("tenants", "storage_bytes")
    op.drop_column("tinker_requests", "output_bytes")
