"""Provenance: the protocol an evaluation ran under, its suite's definition hash, the host of each episode.

- ``evaluations.protocol``: the record of what produced its numbers, written at creation in
  the same transaction as its episodes (``services.store.provenance.build_protocol``): suite
  name, definition hash and simulator family, tasks with the step limits used, seeds and the
  seed rule, cameras, inference settings, the policy's identity, EvalForge's version and source
  commit. NULL for evaluations made before this revision: they compare on their columns.
- ``evaluations.definition_hash``: ``Suite.definition_hash()`` at creation, indexed: the
  leaderboard ranks one definition of a suite at a time. NULL for older rows, which the
  default (current-definition) leaderboard leaves out and no ``?definition=`` selects.
- ``episodes.worker_host``: the host name of the worker that played it (``worker_id`` names
  the process, which a restart changes); NULL for older episodes and those never played.
- ``episodes.renderer``: what rendered its frames, for MuJoCo simulators the OpenGL backend
  (``MUJOCO_GL``: ``egl``, ``osmesa``…; frames differ between them); NULL for the others. A
  column of its own rather than a key of ``simulator_versions``, which maps packages to versions.

All nullable without a default, so adding them is a metadata-only change on PostgreSQL and
every older row stays readable.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("protocol", JSON_DOC, nullable=True))
        batch.add_column(sa.Column("definition_hash", sa.String(64), nullable=True))
        batch.create_index("ix_evaluations_suite_definition_hash", ["suite", "definition_hash"])
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("worker_host", sa.String(200), nullable=True))
        batch.add_column(sa.Column("renderer", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("renderer")
        batch.drop_column("worker_host")
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_index("ix_evaluations_suite_definition_hash")
        batch.drop_column("definition_hash")
        batch.drop_column("protocol")
