"""The finalisation check's index: an evaluation's live episodes.

- ``ix_episodes_live_evaluation_id``: a partial index on ``episodes(evaluation_id)`` over the rows
  whose status is ``pending`` or ``running`` only. ``queries.finalize_evaluation_if_done`` asks
  "is any episode of this evaluation left?" after every result; without it that scanned all of
  the evaluation's rows (40 ms on a 100,000-episode evaluation, docs/benchmarks.md). The index
  holds only the rows still to run, so it shrinks as an evaluation finishes.

An index only: no row changes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIVE = "status IN ('pending', 'running')"


def upgrade() -> None:
    op.create_index("ix_episodes_live_evaluation_id", "episodes", ["evaluation_id"],
                    postgresql_where=sa.text(LIVE), sqlite_where=sa.text(LIVE))


def downgrade() -> None:
    op.drop_index("ix_episodes_live_evaluation_id", table_name="episodes")
