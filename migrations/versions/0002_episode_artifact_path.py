"""Episodes link their replay GIF: ``episodes.artifact_path`` (nullable).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable without a default: a metadata-only change on PostgreSQL, no table rewrite.
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("artifact_path", sa.String(1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("artifact_path")
