"""Large evaluations get their episode rows after the 202: ``evaluations.episodes_unmaterialized``.

- ``evaluations.episodes_unmaterialized`` (integer, not null, default 0): how many of the
  evaluation's planned episodes have no row yet — always the last ones, from index
  ``episodes_total - episodes_unmaterialized`` on. ``queries.create_evaluation`` writes a large
  evaluation (more than ``queries.INLINE_EPISODES`` episodes) with the count at
  ``episodes_total`` and no episode rows; ``queries.materialize_episodes`` writes them in chunks
  after the 202 and counts down; finalisation waits for 0. Every row that exists before this
  revision has all its episode rows: 0, the server default, says so (a constant default, so
  adding the column is a metadata-only change on PostgreSQL 11+, no table rewrite).
- ``ix_evaluations_unmaterialized``: a partial index on ``evaluations(id)`` over the rows whose
  count is above 0 only — the sweeper's scan for a materialisation an API process left unfinished
  (killed after its 202) reads only those.

Downgrade: drops both. An evaluation still materialising at that moment would keep the rows it
has and lose the plan for the rest; downgrade with none in progress (``SELECT id FROM evaluations
WHERE episodes_unmaterialized > 0`` empty), as with any migration under live traffic.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNMATERIALIZED = "episodes_unmaterialized > 0"


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("episodes_unmaterialized", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_evaluations_unmaterialized", "evaluations", ["id"],
                    postgresql_where=sa.text(UNMATERIALIZED), sqlite_where=sa.text(UNMATERIALIZED))


def downgrade() -> None:
    op.drop_index("ix_evaluations_unmaterialized", table_name="evaluations")
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_column("episodes_unmaterialized")
