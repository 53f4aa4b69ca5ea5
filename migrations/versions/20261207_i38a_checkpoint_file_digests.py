"""A checkpoint records its files as committed: ``files``, each one's name, size and SHA-256.

Readers check what the store holds against it (a file missing, or of another size, is a
damaged checkpoint), and a worker checks the SHA-256 of each file it downloads. Rows
committed before this revision have none (null): they are checked by their total size.

Revision ID: i38a
Revises: i26a
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "i38a"
down_revision: str | Sequence[str] | None = "i26a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
        batch.add_column(sa.Column("files", json, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("files")
