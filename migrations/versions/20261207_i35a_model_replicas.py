"""A model served by several workers (issue 35): ``model_replicas`` holds the workers that
serve a model besides its home (``models.worker_id``, which trains it), and
``model_events`` the scheduler's decisions about them with their reasons.

Existing models have no replicas (one worker each, as before). Downgrading drops both tables.

Revision ID: i35a
Revises: i38s
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i35a"
down_revision: str | Sequence[str] | None = "i38s"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
EVENT_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "model_replicas",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("model_id", sa.String(32), nullable=False),
        sa.Column("worker_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_model_replicas_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"],
            ["workers.id"],
            name=op.f("fk_model_replicas_worker_id_workers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_replicas")),
        sa.UniqueConstraint(
            "model_id", "worker_id", name=op.f("uq_model_replicas_model_id_worker_id")
        ),
    )
    op.create_index(op.f("ix_model_replicas_model_id"), "model_replicas", ["model_id"])
    op.create_index(op.f("ix_model_replicas_worker_id"), "model_replicas", ["worker_id"])
    op.create_table(
        "model_events",
        sa.Column("id", EVENT_ID, autoincrement=True, nullable=False),
        sa.Column("model_id", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(32), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_model_events_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_events")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_model_events_model_id_id"), "model_events", ["model_id", "id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_model_events_model_id_id"), table_name="model_events")
    op.drop_table("model_events")
    op.drop_index(op.f("ix_model_replicas_worker_id"), table_name="model_replicas")
    op.drop_index(op.f("ix_model_replicas_model_id"), table_name="model_replicas")
    op.drop_table("model_replicas")
