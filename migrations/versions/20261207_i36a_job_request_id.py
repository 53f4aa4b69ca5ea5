"""A training job keeps the request id of the call that created it (``request_id``), so the
worker's and the trainer's lines for the job carry it, as the control plane's lines of that
call do (issue 36: a job could not be followed by id from the call to the trainer).

Jobs created before have none (null). Downgrading drops the column.

Revision ID: i36a
Revises: i38e
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i36a"
down_revision: str | Sequence[str] | None = "i38e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("request_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.drop_column("request_id")
