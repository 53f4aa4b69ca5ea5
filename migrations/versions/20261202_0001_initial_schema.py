"""Initial schema: tenants, API keys, models, checkpoints, trajectory batches, training jobs
and their events, workers.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the column types in skytrain_backend.db.models: a revision must not change
# when the models module does.
ID = sa.String(length=32)
NAME = sa.String(length=128)
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)
EVENT_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "workers",
        sa.Column("id", ID, nullable=False),
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("cluster_name", NAME, nullable=True),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("engine_endpoint", sa.Text(), nullable=True),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("engine_secret", NAME, nullable=False),
        sa.Column("capacity", JSON, nullable=False),
        sa.Column("hardware", JSON, nullable=False),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.Column("last_heartbeat_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("stopped_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_workers_token_hash")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("name", NAME, nullable=True),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_used_at", TIMESTAMP, nullable=True),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_api_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "models",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("entity", NAME, nullable=False),
        sa.Column("project", NAME, nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("config", JSON, nullable=False),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_models_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint(
            "tenant_id",
            "entity",
            "project",
            "name",
            name=op.f("uq_models_tenant_id_entity_project_name"),
        ),
    )
    op.create_index(op.f("ix_models_tenant_id"), "models", ["tenant_id"])
    op.create_table(
        "checkpoints",
        sa.Column("id", ID, nullable=False),
        sa.Column("model_id", ID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=True),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("deleted_at", TIMESTAMP, nullable=True),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_checkpoints_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("model_id", "step", name=op.f("uq_checkpoints_model_id_step")),
    )
    op.create_table(
        "training_jobs",
        sa.Column("id", ID, nullable=False),
        sa.Column("model_id", ID, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("config", JSON, nullable=False),
        sa.Column("input_uri", sa.Text(), nullable=False),
        sa.Column("num_groups", sa.Integer(), nullable=False),
        sa.Column("num_trajectories", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", ID, nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("result_step", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_training_jobs_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"],
            ["workers.id"],
            name=op.f("fk_training_jobs_worker_id_workers"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_jobs")),
    )
    op.create_index(op.f("ix_training_jobs_model_id"), "training_jobs", ["model_id"])
    op.create_index(
        op.f("ix_training_jobs_status_created_at"), "training_jobs", ["status", "created_at"]
    )
    op.create_index(op.f("ix_training_jobs_worker_id"), "training_jobs", ["worker_id"])
    op.create_table(
        "trajectory_batches",
        sa.Column("id", ID, nullable=False),
        sa.Column("model_id", ID, nullable=False),
        sa.Column("split", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("num_groups", sa.Integer(), nullable=False),
        sa.Column("num_trajectories", sa.Integer(), nullable=False),
        sa.Column("metrics", JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_trajectory_batches_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trajectory_batches")),
    )
    op.create_index(
        op.f("ix_trajectory_batches_model_id_split_step"),
        "trajectory_batches",
        ["model_id", "split", "step"],
    )
    op.create_table(
        "training_job_events",
        sa.Column("id", EVENT_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("type", sa.String(length=32), nullable=False),
        sa.Column("data", JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["training_jobs.id"],
            name=op.f("fk_training_job_events_job_id_training_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_job_events")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        op.f("ix_training_job_events_job_id_id"), "training_job_events", ["job_id", "id"]
    )


def downgrade() -> None:
    # Dropping a table drops its indexes with it, on both databases.
    for table in (
        "training_job_events",
        "trajectory_batches",
        "training_jobs",
        "checkpoints",
        "models",
        "api_keys",
        "workers",
        "tenants",
    ):
        op.drop_table(table)
