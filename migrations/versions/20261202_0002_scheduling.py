"""Scheduling: model placement and activity, served checkpoints, attempt base step, worker
join tokens.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)
NAME = sa.String(length=128)
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("worker_id", ID, nullable=True))
        batch.add_column(sa.Column("last_active_at", TIMESTAMP, nullable=True))
        batch.create_index(batch.f("ix_models_worker_id"), ["worker_id"])
        batch.create_foreign_key(
            batch.f("fk_models_worker_id_workers"),
            "workers",
            ["worker_id"],
            ["id"],
            ondelete="SET NULL",
        )
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("last_requested_at", TIMESTAMP, nullable=True))
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("base_step", sa.Integer(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("served_model_name", sa.String(length=512), nullable=True))
        batch.add_column(
            sa.Column("served", JSON, nullable=False, server_default=sa.text("'[]'"))
        )
        batch.add_column(sa.Column("last_active_at", TIMESTAMP, nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.alter_column("served", server_default=None)
    op.create_table(
        "worker_tokens",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", NAME, nullable=True),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=512), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_used_at", TIMESTAMP, nullable=True),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_worker_tokens_token_hash")),
    )


def downgrade() -> None:
    op.drop_table("worker_tokens")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("last_active_at")
        batch.drop_column("served")
        batch.drop_column("served_model_name")
    with op.batch_alter_table("training_jobs") as batch:
        batch.drop_column("base_step")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("last_requested_at")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint(batch.f("fk_models_worker_id_workers"), type_="foreignkey")
        batch.drop_index(batch.f("ix_models_worker_id"))
        batch.drop_column("last_active_at")
        batch.drop_column("worker_id")
