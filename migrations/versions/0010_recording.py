"""Rollout recording: which episodes of an evaluation are recorded, and where each recording is.

- ``evaluations.record``: ``none`` (the default, and every evaluation made before this
  revision), ``first`` (the first episode of each task: the lowest episode index per task),
  ``failures`` (every scored episode that did not succeed) or ``all``. Not part of the
  evaluation's protocol: recording does not change what an episode does, so it does not
  change comparability (``services.store.provenance``).
- ``episodes.recording_path``: the episode's recording (states, actions, the evaluation's
  camera frames at the inference steps; ``services/workers/recording.py``), relative to the
  workers' ``ARTIFACT_ROOT``; NULL where it was not recorded. ``evalforge eval dataset``
  assembles an evaluation's recordings into a LeRobot v3 dataset.

The new ``record`` column has a constant server default, so adding it is a metadata-only
change on PostgreSQL (11+); the CHECK constraint is built from ``RecordMode``'s values.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MODES = ("none", "first", "failures", "all")


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("record", sa.String(16), nullable=False, server_default="none"))
        batch.create_check_constraint("ck_evaluations_record",
                                      "record IN (" + ", ".join(f"'{m}'" for m in MODES) + ")")
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("recording_path", sa.String(1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("recording_path")
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_constraint("ck_evaluations_record", type_="check")
        batch.drop_column("record")
