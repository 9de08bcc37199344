"""Initial schema: policies, evaluations (+ tags), episodes, API keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The same type expressions as services/store/models.py (frozen here: a migration must
# not change when the models do).
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TIMESTAMP = sa.DateTime(timezone=True)

EVALUATION_STATUSES = "'pending', 'running', 'finished', 'cancelled', 'failed'"
EPISODE_STATUSES = "'pending', 'running', 'succeeded', 'failed', 'cancelled'"
FAILURE_REASONS = "'policy_timeout', 'policy_error', 'env_error', 'worker_lost', 'cancelled'"


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_sha256", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_sha256", name="uq_api_keys_key_sha256"),
    )
    op.create_table(
        "policies",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.String(100), nullable=False),
        sa.Column("endpoint", sa.String(2000), nullable=False),
        sa.Column("checkpoint_sha256", sa.String(64), nullable=False),
        sa.Column("state_dim", sa.Integer(), nullable=False),
        sa.Column("action_dim", sa.Integer(), nullable=False),
        sa.Column("chunk_size", sa.Integer(), nullable=False),
        sa.Column("tasks", JSON_DOC, nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_policies"),
        sa.UniqueConstraint("name", "version", name="uq_policies_name_version"),
    )
    op.create_table(
        "evaluations",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("policy_id", BIG_ID, nullable=False),
        sa.Column("suite", sa.String(200), nullable=False),
        sa.Column("tasks", JSON_DOC, nullable=False),
        sa.Column("episodes_per_task", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("max_steps", sa.Integer(), nullable=True),
        sa.Column("standard", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_sha256", sa.String(64), nullable=True),
        sa.Column("episodes_total", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("cancelled_at", TIMESTAMP, nullable=True),
        sa.Column("episodes_scored", sa.Integer(), nullable=True),
        sa.Column("episodes_succeeded", sa.Integer(), nullable=True),
        sa.Column("success_rate", sa.Float(), nullable=True),
        sa.Column("success_ci_low", sa.Float(), nullable=True),
        sa.Column("success_ci_high", sa.Float(), nullable=True),
        sa.Column("aggregates", JSON_DOC, nullable=True),
        sa.CheckConstraint(f"status IN ({EVALUATION_STATUSES})", name="ck_evaluations_status"),
        sa.ForeignKeyConstraint(["policy_id"], ["policies.id"], name="fk_evaluations_policy_id_policies",
                                ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("id", name="pk_evaluations"),
        sa.UniqueConstraint("idempotency_key", name="uq_evaluations_idempotency_key"),
    )
    op.create_index("ix_evaluations_leaderboard", "evaluations", ["suite", "status", "policy_id", "success_rate"])
    op.create_index("ix_evaluations_policy_id_id", "evaluations", ["policy_id", "id"])
    op.create_index("ix_evaluations_status_id", "evaluations", ["status", "id"])
    op.create_index("ix_evaluations_suite_id", "evaluations", ["suite", "id"])
    op.create_table(
        "evaluation_tags",
        sa.Column("evaluation_id", BIG_ID, nullable=False),
        sa.Column("tag", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"],
                                name="fk_evaluation_tags_evaluation_id_evaluations", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("evaluation_id", "tag", name="pk_evaluation_tags"),
    )
    op.create_index("ix_evaluation_tags_tag_evaluation_id", "evaluation_tags", ["tag", "evaluation_id"])
    op.create_table(
        "episodes",
        sa.Column("id", BIG_ID, nullable=False),
        sa.Column("evaluation_id", BIG_ID, nullable=False),
        sa.Column("episode_index", sa.Integer(), nullable=False),
        sa.Column("task", sa.String(200), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("max_steps", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=True),
        sa.Column("total_return", sa.Float(), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("latency_mean_ms", sa.Float(), nullable=True),
        sa.Column("latency_p95_ms", sa.Float(), nullable=True),
        sa.Column("failure_reason", sa.String(32), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(f"status IN ({EPISODE_STATUSES})", name="ck_episodes_status"),
        sa.CheckConstraint(f"failure_reason IS NULL OR failure_reason IN ({FAILURE_REASONS})",
                           name="ck_episodes_failure_reason"),
        sa.ForeignKeyConstraint(["evaluation_id"], ["evaluations.id"], name="fk_episodes_evaluation_id_evaluations",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_episodes"),
        sa.UniqueConstraint("evaluation_id", "episode_index", name="uq_episodes_evaluation_id_episode_index"),
    )
    op.create_index("ix_episodes_status_lease_expires_at", "episodes", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_episodes_status_lease_expires_at", table_name="episodes")
    op.drop_table("episodes")
    op.drop_index("ix_evaluation_tags_tag_evaluation_id", table_name="evaluation_tags")
    op.drop_table("evaluation_tags")
    op.drop_index("ix_evaluations_suite_id", table_name="evaluations")
    op.drop_index("ix_evaluations_status_id", table_name="evaluations")
    op.drop_index("ix_evaluations_policy_id_id", table_name="evaluations")
    op.drop_index("ix_evaluations_leaderboard", table_name="evaluations")
    op.drop_table("evaluations")
    op.drop_table("policies")
    op.drop_table("api_keys")
