"""API-key scopes and ownership: ``api_keys.scopes``; ``created_by_key_id`` on policies and
evaluations; idempotency keys unique per API key.

Keys that exist before this migration could do every write, so they become
``submit,admin`` (they keep what they could do; the migration logs how many). New keys
get ``submit`` unless created with ``--scope``. Policies and evaluations made before it
have no recorded owner (NULL): only an admin key can change or cancel them.

Downgrade drops the scopes. Since every key can write again after it, keys with the
``read`` scope are revoked (and logged) rather than silently promoted; an idempotency
key reused by two API keys is kept only on the oldest evaluation, so the global unique
constraint can come back.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

# Frozen copies of the models' types (a migration must not change when the models do).
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
EXISTING_KEYS_SCOPES = "submit,admin"


def _count(sql: str) -> int | None:
    """A count from the live database; None when emitting SQL offline (``--sql``)."""
    if context.is_offline_mode():
        return None
    return int(op.get_bind().execute(sa.text(sql)).scalar_one())


def upgrade() -> None:
    existing_keys = _count("SELECT count(*) FROM api_keys")
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("scopes", sa.String(64), nullable=True))
    op.execute(sa.text(f"UPDATE api_keys SET scopes = '{EXISTING_KEYS_SCOPES}'"))
    with op.batch_alter_table("api_keys") as batch:
        batch.alter_column("scopes", existing_type=sa.String(64), nullable=False)
    if existing_keys != 0:
        shown = "every existing API key" if existing_keys is None else f"{existing_keys} existing API key(s)"
        log.warning("migration 0003: %s now have scopes %s (admin: they keep every write they could do); "
                    "new keys from `evalforge apikey create` get scope submit. Revoke and recreate any that "
                    "should not be admins (`evalforge apikey list`, `evalforge apikey revoke ID`).",
                    shown, EXISTING_KEYS_SCOPES)

    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("created_by_key_id", BIG_ID, nullable=True))
        batch.create_foreign_key("fk_policies_created_by_key_id_api_keys", "api_keys",
                                 ["created_by_key_id"], ["id"], ondelete="SET NULL")
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("created_by_key_id", BIG_ID, nullable=True))
        batch.create_foreign_key("fk_evaluations_created_by_key_id_api_keys", "api_keys",
                                 ["created_by_key_id"], ["id"], ondelete="SET NULL")
        batch.drop_constraint("uq_evaluations_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_evaluations_created_by_key_id_idempotency_key",
                                       ["created_by_key_id", "idempotency_key"])


def downgrade() -> None:
    # One evaluation per idempotency key again: the oldest keeps it.
    op.execute(sa.text(
        "UPDATE evaluations SET idempotency_key = NULL WHERE idempotency_key IS NOT NULL AND id NOT IN "
        "(SELECT min_id FROM (SELECT min(id) AS min_id FROM evaluations WHERE idempotency_key IS NOT NULL "
        "GROUP BY idempotency_key) AS oldest)"))
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_constraint("uq_evaluations_created_by_key_id_idempotency_key", type_="unique")
        batch.create_unique_constraint("uq_evaluations_idempotency_key", ["idempotency_key"])
        batch.drop_constraint("fk_evaluations_created_by_key_id_api_keys", type_="foreignkey")
        batch.drop_column("created_by_key_id")
    with op.batch_alter_table("policies") as batch:
        batch.drop_constraint("fk_policies_created_by_key_id_api_keys", type_="foreignkey")
        batch.drop_column("created_by_key_id")

    read_only = _count("SELECT count(*) FROM api_keys WHERE scopes = 'read' AND revoked_at IS NULL")
    op.execute(sa.text("UPDATE api_keys SET revoked_at = CURRENT_TIMESTAMP "
                       "WHERE scopes = 'read' AND revoked_at IS NULL"))
    if read_only != 0:
        shown = "read-only API keys" if read_only is None else f"{read_only} read-only API key(s)"
        log.warning("downgrade of migration 0003: revoked %s, because without scopes every key can write",
                    shown)
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("scopes")
