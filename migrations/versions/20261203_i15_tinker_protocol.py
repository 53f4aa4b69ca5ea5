"""The Tinker protocol: sessions, training runs, their operations and sampling requests (the
futures), sampling sessions, and named checkpoints.

Revision ID: i15
Revises: i11
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "i15"
down_revision: str | Sequence[str] | None = "i11"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)
NAME = sa.String(length=128)
JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)


def _tenant(table: str) -> tuple[sa.Column[str], sa.ForeignKeyConstraint]:
    return sa.Column("tenant_id", ID, nullable=False), sa.ForeignKeyConstraint(
        ["tenant_id"], ["tenants.id"], name=op.f(f"fk_{table}_tenant_id_tenants"), ondelete="CASCADE"
    )


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", ID, nullable=False),
        *_tenant("tinker_sessions"),
        sa.Column("sdk_version", sa.String(length=64), nullable=False),
        sa.Column("tags", JSON, nullable=False),
        sa.Column("user_metadata", JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_heartbeat_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("finish_status", sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tinker_sessions")),
    )
    op.create_index(op.f("ix_tinker_sessions_tenant_id"), "tinker_sessions", ["tenant_id"])
    op.create_table(
        "tinker_samplers",
        sa.Column("id", ID, nullable=False),
        *_tenant("tinker_samplers"),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("model_id", ID, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("model_path", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["models.id"],
            name=op.f("fk_tinker_samplers_model_id_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tinker_samplers")),
    )
    op.create_index(op.f("ix_tinker_samplers_model_id"), "tinker_samplers", ["model_id"])
    op.create_index(op.f("ix_tinker_samplers_tenant_id"), "tinker_samplers", ["tenant_id"])
    op.create_table(
        "tinker_runs",
        sa.Column("id", NAME, nullable=False),
        *_tenant("tinker_runs"),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("model_id", ID, nullable=False),
        sa.Column("job_id", ID, nullable=False),
        sa.Column("lora_config", JSON, nullable=False),
        sa.Column("user_metadata", JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_request_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["training_jobs.id"],
            name=op.f("fk_tinker_runs_job_id_training_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_tinker_runs_model_id_models"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["tinker_sessions.id"],
            name=op.f("fk_tinker_runs_session_id_tinker_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tinker_runs")),
        sa.UniqueConstraint("model_id", name=op.f("uq_tinker_runs_model_id")),
    )
    op.create_index(op.f("ix_tinker_runs_session_id"), "tinker_runs", ["session_id"])
    op.create_index(op.f("ix_tinker_runs_tenant_id"), "tinker_runs", ["tenant_id"])
    op.create_table(
        "tinker_checkpoints",
        sa.Column("id", ID, nullable=False),
        sa.Column("run_id", NAME, nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", NAME, nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("user_metadata", JSON, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["tinker_runs.id"],
            name=op.f("fk_tinker_checkpoints_run_id_tinker_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tinker_checkpoints")),
        sa.UniqueConstraint(
            "run_id", "kind", "name", name=op.f("uq_tinker_checkpoints_run_id_kind_name")
        ),
    )
    op.create_table(
        "tinker_requests",
        sa.Column("id", ID, nullable=False),
        *_tenant("tinker_requests"),
        sa.Column("run_id", NAME, nullable=True),
        sa.Column("seq_id", sa.Integer(), nullable=True),
        sa.Column("sampler_id", ID, nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("params", JSON, nullable=False),
        sa.Column("input_uri", sa.Text(), nullable=True),
        sa.Column("result", JSON, nullable=True),
        sa.Column("result_uri", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(length=16), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["tinker_runs.id"],
            name=op.f("fk_tinker_requests_run_id_tinker_runs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["sampler_id"],
            ["tinker_samplers.id"],
            name=op.f("fk_tinker_requests_sampler_id_tinker_samplers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tinker_requests")),
        sa.UniqueConstraint("run_id", "seq_id", name=op.f("uq_tinker_requests_run_id_seq_id")),
    )
    op.create_index(op.f("ix_tinker_requests_sampler_id"), "tinker_requests", ["sampler_id"])
    op.create_index(op.f("ix_tinker_requests_tenant_id"), "tinker_requests", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("tinker_requests")
    op.drop_table("tinker_checkpoints")
    op.drop_table("tinker_runs")
    op.drop_table("tinker_samplers")
    op.drop_table("tinker_sessions")
