"""Alembic owns the schema: upgrade from empty, no drift from the models, downgrade works (both backends)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from services.store import migrate
from services.store.db import create_db_engine
from services.store.models import Base
from tests.store.databases import create_postgres_database, drop_postgres_database

TABLES = {"api_keys", "policies", "policy_endpoints", "evaluations", "evaluation_tags", "episodes", "workers"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_database(request, tmp_path):
    """A database with nothing in it (not even the migrations), on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    base = request.getfixturevalue("postgres_url")
    url = create_postgres_database(base, prefix="evalforge_migrations")
    try:
        yield url
    finally:
        drop_postgres_database(url, base)


def _diff(url: str) -> list:
    engine = create_db_engine(url=url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_db_engine(url=url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_from_empty_matches_the_models_and_downgrade_reverts(empty_database):
    migrate.upgrade(empty_database)
    assert _tables(empty_database) == TABLES
    assert _diff(empty_database) == [], "models and migrations disagree: write a migration (alembic revision " \
                                        "--autogenerate) for the model change"
    migrate.check_current(empty_database)

    head = migrate.head_revision()
    migrate.downgrade(empty_database, "-1")
    engine = create_db_engine(url=empty_database)
    try:
        assert migrate.current_revision(engine) != head
    finally:
        engine.dispose()
    with pytest.raises(migrate.SchemaNotCurrent, match="evalforge db upgrade"):
        migrate.check_current(empty_database)

    migrate.upgrade(empty_database)  # and back up again: the downgrade left a clean slate
    assert _diff(empty_database) == []
    migrate.downgrade(empty_database, "base")
    assert _tables(empty_database) == set()


def test_a_model_change_without_a_migration_is_detected(empty_database):
    from sqlalchemy import Column, Integer, MetaData, Table

    migrate.upgrade(empty_database)
    changed = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(changed)
    Table("new_table", changed, Column("id", Integer, primary_key=True))
    engine = create_db_engine(url=empty_database)
    try:
        with engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), changed)
    finally:
        engine.dispose()
    assert [op[0] for op in diff] == ["add_table"]


def test_the_alembic_command_reads_database_url(empty_database):
    """What an operator types: ``alembic upgrade head`` at the repository root, with only
    ``DATABASE_URL`` set (env.py's StoreSettings path, not the attributes migrate.py passes)."""
    def alembic(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "alembic", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=120, env={**os.environ, "DATABASE_URL": empty_database})
        assert result.returncode == 0, result.stderr
        return result

    alembic("upgrade", "head")
    assert _tables(empty_database) == TABLES
    alembic("check")  # autogenerate finds nothing to do
    alembic("downgrade", "-1")
    engine = create_db_engine(url=empty_database)
    try:
        assert migrate.current_revision(engine) != migrate.head_revision()
    finally:
        engine.dispose()
