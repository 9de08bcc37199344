"""Two failure reasons: ``checkpoint_mismatch`` and ``endpoint_refused`` (both harness failures).

A worker fails an episode with ``checkpoint_mismatch`` when the server at the policy's
endpoint names another checkpoint than the one registered, and with ``endpoint_refused``
when the endpoint's host is outside ``EVALFORGE_POLICY_HOSTS``. The episodes'
``failure_reason`` CHECK constraint is widened to allow them; downgrading narrows it
again, after turning such episodes into ``env_error`` (the harness failure that existed
before), so no row breaks the older constraint.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here (a migration must not change when services/store/statuses.py does).
BEFORE = ("policy_timeout", "policy_error", "env_error", "worker_lost", "cancelled")
ADDED = ("checkpoint_mismatch", "endpoint_refused")
# The name 0001 gave it; the metadata's naming convention (``ck_%(table_name)s_%(constraint_name)s``)
# applies to it on the way to the database, in 0001 as here, so both name the same constraint.
CONSTRAINT = "ck_episodes_failure_reason"


def _check(reasons: Sequence[str]) -> str:
    return "failure_reason IS NULL OR failure_reason IN (" + ", ".join(f"'{r}'" for r in reasons) + ")"


def _replace_check(reasons: Sequence[str]) -> None:
    # On SQLite batch mode recreates the table (with the constraint dropped and the new one
    # added); on PostgreSQL these are two ALTER TABLE statements in the migration's transaction.
    with op.batch_alter_table("episodes") as batch:
        batch.drop_constraint(CONSTRAINT, type_="check")
        batch.create_check_constraint(CONSTRAINT, _check(reasons))


def upgrade() -> None:
    _replace_check(BEFORE + ADDED)


def downgrade() -> None:
    episodes = sa.table("episodes", sa.column("failure_reason", sa.String(32)))
    op.execute(episodes.update().where(episodes.c.failure_reason.in_(ADDED)).values(failure_reason="env_error"))
    _replace_check(BEFORE)
