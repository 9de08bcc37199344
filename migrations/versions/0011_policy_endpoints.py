"""Policy replicas: further servers of a policy's checkpoint.

- ``policy_endpoints``: one row per extra endpoint of a policy (``policies.endpoint`` stays
  its first one), unique per ``(policy_id, endpoint)``, deleted with its policy. Each was
  checked by its handshake when added (the same checkpoint sha256 or revision as the policy).
  Workers spread the policy's episodes over all of them and fail over between them
  (``services/workers/replicas.py``).

A new table, so every older row stays as it was (a policy without rows here has one server).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "policy_endpoints",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("policy_id", BIG_ID, sa.ForeignKey("policies.id", ondelete="CASCADE",
                                                     name="fk_policy_endpoints_policy_id_policies"),
                  nullable=False),
        sa.Column("endpoint", sa.String(2000), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by_key_id", BIG_ID, sa.ForeignKey("api_keys.id", ondelete="SET NULL",
                                                             name="fk_policy_endpoints_created_by_key_id_api_keys"),
                  nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_policy_endpoints"),
        sa.UniqueConstraint("policy_id", "endpoint", name="uq_policy_endpoints_policy_id_endpoint"),
    )


def downgrade() -> None:
    op.drop_table("policy_endpoints")
