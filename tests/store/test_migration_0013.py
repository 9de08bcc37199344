"""Migration 0013 (``evaluations.episodes_unmaterialized``) keeps the rows it finds, on both backends:
an evaluation made before it has all its episode rows (0 still to write) and finalises as before;
downgrading drops the column and its index and keeps every row."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from services.store import migrate, queries
from services.store.db import create_db_engine, make_session_factory
from tests.store.databases import create_postgres_database, drop_postgres_database

ROWS = (
    "INSERT INTO policies (id, name, version, endpoint, protocol, tasks, created_at) "
    "VALUES (1, 'bc', 'v1', 'ws://x.test/ws', 'evalforge', '[]', '2026-12-01 00:00:00+00')",
    "INSERT INTO evaluations (id, policy_id, suite, tasks, episodes_per_task, seed, standard, status, "
    "episodes_total, created_at, record) VALUES (1, 1, 'metaworld-mt10', '[\"reach-v3\"]', 2, 0, true, 'running', "
    "2, '2026-12-01 00:00:00+00', 'none')",
    "INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, attempts, created_at) "
    "VALUES (1, 0, 'reach-v3', 1000000, 500, 'succeeded', 1, '2026-12-01 00:00:00+00'), "
    "(1, 1, 'reach-v3', 1000001, 500, 'running', 1, '2026-12-01 00:00:00+00')",
)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_at_0012(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.db'}"
        migrate.upgrade(url, "0012")
        yield url
        return
    base = request.getfixturevalue("postgres_url")
    url = create_postgres_database(base, prefix="evalforge_migration_0013")
    try:
        migrate.upgrade(url, "0012")
        yield url
    finally:
        drop_postgres_database(url, base)


def _columns(engine) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns("evaluations")}


def _counts(engine) -> tuple[int, int, int]:
    with engine.connect() as connection:
        return tuple(connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                     for table in ("policies", "evaluations", "episodes"))


def test_0013_up_and_down_keeps_evaluations_and_their_episodes(database_at_0012):
    engine = create_db_engine(url=database_at_0012)
    try:
        with engine.begin() as connection:
            for statement in ROWS:
                connection.execute(text(statement.replace("true", "1") if engine.dialect.name == "sqlite"
                                        else statement))
        migrate.upgrade(database_at_0012, "0013")
        assert "episodes_unmaterialized" in _columns(engine) and _counts(engine) == (1, 1, 2)
        assert "ix_evaluations_unmaterialized" in {i["name"] for i in inspect(engine).get_indexes("evaluations")}
        sessions = make_session_factory(engine)
        with sessions() as session:
            evaluation = queries.get_evaluation(session, 1)
            assert evaluation.episodes_unmaterialized == 0  # every earlier evaluation has all its rows
            assert queries.evaluation_results(session, evaluation)["counts"]["running"] == 1
            episode_id = queries.list_episodes(session, 1)[1].id
            assert queries.finish_episode(session, episode_id, success=False, steps=500)
            assert queries.finalize_evaluation_if_done(session, 1)  # finalises as before 0013

        migrate.downgrade(database_at_0012, "0012")
        assert "episodes_unmaterialized" not in _columns(engine) and _counts(engine) == (1, 1, 2)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT status FROM evaluations")).scalar_one() == "finished"
        migrate.upgrade(database_at_0012)  # and up again
        assert _counts(engine) == (1, 1, 2)
    finally:
        engine.dispose()
