"""Cameras: what a policy asks to see (``policies.cameras``) and what an evaluation renders
(``evaluations.cameras``), both ``{camera: [height, width]}``.

A policy's cameras come from its server's handshake; an evaluation records the cameras
its workers render and send (the policy's, or the request's override), so its results
say what the policy was shown. Both are nullable without a default: rows written before
this revision read as "no cameras" (state-only, which is what they were), and adding the
columns is a metadata-only change on PostgreSQL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    for table in ("policies", "evaluations"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("cameras", JSON_DOC, nullable=True))


def downgrade() -> None:
    for table in ("policies", "evaluations"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("cameras")
