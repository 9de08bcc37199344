"""Migrations keep the rows they find: an SQLite store with an evaluation and its episodes, upgraded from
0008 to head and downgraded back, still has them.

SQLite's batch mode rebuilds a table to change a constraint (0010 adds the CHECK on
``evaluations.record``): with foreign keys on, dropping the old ``evaluations`` would cascade-delete
every episode, which is why ``migrations/env.py`` switches them off while it migrates."""

from __future__ import annotations

from sqlalchemy import text

from services.store import migrate
from services.store.db import create_db_engine

ROWS = (
    "INSERT INTO policies (id, name, version, endpoint, protocol, tasks, created_at) "
    "VALUES (1, 'bc', 'v1', 'ws://x.test/ws', 'evalforge', '[]', '2026-12-01 00:00:00')",
    "INSERT INTO evaluations (id, policy_id, suite, tasks, episodes_per_task, seed, standard, status, "
    "episodes_total, created_at) VALUES (1, 1, 'metaworld-mt10', '[\"reach-v3\"]', 2, 0, 1, 'running', 2, "
    "'2026-12-01 00:00:00')",
    "INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, attempts, created_at) "
    "VALUES (1, 0, 'reach-v3', 1000000, 500, 'succeeded', 1, '2026-12-01 00:00:00'), "
    "(1, 1, 'reach-v3', 1000001, 500, 'pending', 0, '2026-12-01 00:00:00')",
)


def _counts(engine) -> tuple[int, int, int]:
    with engine.connect() as connection:
        return tuple(connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                     for table in ("policies", "evaluations", "episodes"))


def test_upgrading_and_downgrading_sqlite_keeps_evaluations_and_their_episodes(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.db'}"
    migrate.upgrade(url, "0008")
    engine = create_db_engine(url=url)
    try:
        with engine.begin() as connection:
            for statement in ROWS:
                connection.execute(text(statement))
        migrate.upgrade(url)
        assert _counts(engine) == (1, 1, 2)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT record FROM evaluations")).scalar_one() == "none"
            assert connection.execute(text("PRAGMA foreign_keys")).scalar_one() == 1, "back on after migrating"
        migrate.downgrade(url, "0008")
        assert _counts(engine) == (1, 1, 2)
    finally:
        engine.dispose()
