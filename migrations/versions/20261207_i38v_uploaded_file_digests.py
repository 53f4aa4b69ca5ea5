"""An uploaded file records the SHA-256 of its bytes (``uploaded_files.sha256``), so that
``skytrain storage check --read`` can tell a file changed in the store from the one uploaded.

Files uploaded before this revision record none: their size is still checked, their bytes
are not.

Revision ID: i38v
Revises: i38u
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38v"
down_revision: str | Sequence[str] | None = "i38u"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("uploaded_files") as batch:
        batch.add_column(sa.Column("sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("uploaded_files") as batch:
        batch.drop_column("sha256")
