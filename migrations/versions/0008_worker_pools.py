"""Worker pools per simulator: live workers and their simulators, and the versions each episode ran with.

- ``workers``: one row per running ``evalforge worker`` (its Celery node name), the simulator
  families it serves and the package versions of each, refreshed by its heartbeat
  (``last_seen_at``). The API reads it to say when an evaluation waits for a worker that can
  run its suite; a worker that stopped heartbeating is not live.
- ``episodes.simulator_versions``: the simulator packages (and versions) the episode ran with,
  written with its result; NULL for episodes before this revision.
- ``episodes.initial_state_index``: for suites whose seeds pick one of a fixed set of initial
  states (LIBERO's official init states), the index the episode started from.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("simulators", JSON_DOC, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_workers"),
    )
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("simulator_versions", JSON_DOC, nullable=True))
        batch.add_column(sa.Column("initial_state_index", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("initial_state_index")
        batch.drop_column("simulator_versions")
    op.drop_table("workers")
