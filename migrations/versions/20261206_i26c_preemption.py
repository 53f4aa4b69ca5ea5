"""Training jobs yield their worker at a step boundary and resume from a saved state.

Revision ID: i26c
Revises: i25b
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i26c"
down_revision: str | Sequence[str] | None = "i25b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("leased_at", TIMESTAMP, nullable=True))
        batch.add_column(
            sa.Column("yield_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("preemptions", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
        batch.add_column(sa.Column("saved_attempt", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("saved_steps", sa.Integer(), nullable=True))
    # A tenant's turn is its newest lease: until now, its newest job's first start.
    op.execute("UPDATE training_jobs SET leased_at = started_at")
    with op.batch_alter_table("training_jobs") as batch:
        batch.alter_column("yield_requested", server_default=None)
        batch.alter_column("preemptions", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        for column in ("saved_steps", "saved_attempt", "preemptions", "yield_requested"):
            batch.drop_column(column)
        batch.drop_column("leased_at")
