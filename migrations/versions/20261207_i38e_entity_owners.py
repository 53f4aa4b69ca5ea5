"""Entity names belong to a tenant: ``entities`` holds each name and the tenant that used it
first, its primary key making two first uses of one name a race that one tenant wins.

Existing names go to the tenant named so when it has a model under the name, otherwise to the
tenant whose model under it is oldest. Another tenant's existing models under such a name stay
(and keep working); it only cannot create more there. Downgrading drops the table.

Revision ID: i38e
Revises: i38q
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "i38e"
down_revision: str | Sequence[str] | None = "i38q"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "entities",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_entities_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_entities")),
    )
    op.create_index(op.f("ix_entities_tenant_id"), "entities", ["tenant_id"])
    op.execute(
        "INSERT INTO entities (name, tenant_id, created_at) "
        "SELECT m.entity, m.tenant_id, m.created_at FROM models m WHERE m.id = ("
        " SELECT e.id FROM models e WHERE e.entity = m.entity"
        " ORDER BY CASE WHEN e.tenant_id IN"
        "  (SELECT t.id FROM tenants t WHERE t.name = e.entity) THEN 0 ELSE 1 END,"
        " e.created_at, e.id LIMIT 1)"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_entities_tenant_id"), table_name="entities")
    op.drop_table("entities")
