"""Workers that failed to start count the failed launches in a row for their base model,
and say when the next may go.

Revision ID: i25b
Revises: i16b
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i25b"
down_revision: str | Sequence[str] | None = "i16b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("launch_failures", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("relaunch_after", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("relaunch_after")
        batch.drop_column("launch_failures")
