"""A model records its demand per replica as the scheduler's last pass measured it
(``models.demand_per_replica``), so that ``skytrain models show``, which reads the database,
shows it beside the replicas.

Revision ID: i35b
Revises: i38v
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i35b"
down_revision: str | Sequence[str] | None = "i38v"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("demand_per_replica", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("demand_per_replica")
