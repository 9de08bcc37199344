"""Policies served by other protocols, and inference settings per evaluation.

- ``policies.protocol`` (``evalforge`` | ``openpi`` | ``vla-eval``; existing rows are
  ``evalforge``), ``policies.observation_keys`` (canonical field → the server's key),
  ``policies.revision`` (names the checkpoint where a server has no sha256) and
  ``policies.server_info`` (what the server said at registration, a capped JSON summary).
- ``checkpoint_sha256``, ``state_dim``, ``action_dim`` and ``chunk_size`` become nullable: an
  openpi server says none of them (its evaluations take the action dimension from the
  suite and check every reply against it).
- ``evaluations.inference``: ``{"action_horizon": k | null, "temporal_ensemble": m | null}``;
  NULL (rows before this revision) means the defaults: the whole chunk, no ensembling.

Downgrading removes the columns and the other protocols' policies can no longer be told
apart, so it refuses while any exists (delete them, or their evaluations, first).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOC = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
NULLABLE_NOW = (("checkpoint_sha256", sa.String(64)), ("state_dim", sa.Integer()), ("action_dim", sa.Integer()),
                ("chunk_size", sa.Integer()))


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("protocol", sa.String(16), nullable=False, server_default="evalforge"))
        batch.add_column(sa.Column("observation_keys", JSON_DOC, nullable=True))
        batch.add_column(sa.Column("revision", sa.String(64), nullable=True))
        batch.add_column(sa.Column("server_info", JSON_DOC, nullable=True))
        for name, type_ in NULLABLE_NOW:
            batch.alter_column(name, existing_type=type_, nullable=True)
        batch.create_check_constraint("ck_policies_protocol", "protocol IN ('evalforge', 'openpi', 'vla-eval')")
    with op.batch_alter_table("evaluations") as batch:
        batch.add_column(sa.Column("inference", JSON_DOC, nullable=True))


def downgrade() -> None:
    remote = op.get_bind().execute(sa.text("SELECT count(*) FROM policies WHERE protocol <> 'evalforge'")).scalar()
    if remote:
        raise RuntimeError(f"{remote} policies are served by openpi or vla-eval servers, which revision 0006 "
                           "cannot hold; delete them (and their evaluations) before downgrading")
    with op.batch_alter_table("evaluations") as batch:
        batch.drop_column("inference")
    with op.batch_alter_table("policies") as batch:
        batch.drop_constraint("ck_policies_protocol", type_="check")
        for name, type_ in NULLABLE_NOW:
            batch.alter_column(name, existing_type=type_, nullable=False)
        batch.drop_column("server_info")
        batch.drop_column("revision")
        batch.drop_column("observation_keys")
        batch.drop_column("protocol")
