"""One failure reason: ``policy_unreachable`` (a harness failure).

A worker fails an episode with ``policy_unreachable`` when no try reached the policy
server at all (refused, unknown host, nothing answering as a policy server before the
connect deadline): such an episode says nothing about the policy, so it is left out of
success rates, and an evaluation made mostly of them is not ranked. The episodes'
``failure_reason`` CHECK constraint is widened to allow it; downgrading narrows it
again, after turning such episodes into ``policy_timeout`` (what they were recorded as
before), so no row breaks the older constraint.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here (a migration must not change when services/store/statuses.py does).
BEFORE = ("policy_timeout", "policy_error", "env_error", "worker_lost", "cancelled", "checkpoint_mismatch",
          "endpoint_refused")
ADDED = ("policy_unreachable",)
CONSTRAINT = "ck_episodes_failure_reason"


def _check(reasons: Sequence[str]) -> str:
    return "failure_reason IS NULL OR failure_reason IN (" + ", ".join(f"'{r}'" for r in reasons) + ")"


def _replace_check(reasons: Sequence[str]) -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_constraint(CONSTRAINT, type_="check")
        batch.create_check_constraint(CONSTRAINT, _check(reasons))


def upgrade() -> None:
    _replace_check(BEFORE + ADDED)


def downgrade() -> None:
    episodes = sa.table("episodes", sa.column("failure_reason", sa.String(32)))
    op.execute(episodes.update().where(episodes.c.failure_reason.in_(ADDED)).values(failure_reason="policy_timeout"))
    _replace_check(BEFORE)
