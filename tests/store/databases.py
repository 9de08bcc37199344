"""Scratch databases for the store and API tests, shared by their conftests.

PostgreSQL: one fresh database per test session (``evalforge_test_<random>`` on the
server at ``TEST_DATABASE_URL``), migrated with Alembic, emptied after each test
and dropped at the end. SQLite: one migrated template file per session, copied per
test (a copy is far faster than migrating again).

``store_engine`` is parametrised over both backends; the PostgreSQL case carries the
``postgres`` marker, so it skips (or, in CI, fails) without a server.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from services.store import migrate
from services.store.db import create_db_engine
from services.store.settings import StoreSettings

TABLES = ("episodes", "evaluation_tags", "evaluations", "policy_endpoints", "policies", "api_keys")


def create_postgres_database(base_url: str, prefix: str = "evalforge_test") -> str:
    """Create an empty database beside ``base_url``'s; return its URL."""
    url = make_url(base_url)
    name = f"{prefix}_{secrets.token_hex(4)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        admin.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(database_url: str, base_url: str) -> None:
    name = make_url(database_url).database
    admin = create_engine(make_url(base_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def empty_tables(engine: Engine) -> None:
    with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            connection.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
        else:
            for table in TABLES:
                connection.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(scope="session")
def pg_database(postgres_url) -> Iterator[str]:
    url = create_postgres_database(postgres_url)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        drop_postgres_database(url, postgres_url)


@pytest.fixture(scope="session")
def pg_engine(pg_database) -> Iterator[Engine]:
    engine = create_db_engine(StoreSettings(database_url=pg_database, pool_size=4, max_overflow=16))
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    migrate.upgrade(f"sqlite:///{path}")
    return str(path)


@pytest.fixture
def sqlite_url(sqlite_template, tmp_path) -> str:
    path = tmp_path / "store.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_engine(request) -> Iterator[Engine]:
    """A migrated, empty store on each backend."""
    if request.param == "sqlite":
        engine = create_db_engine(url=request.getfixturevalue("sqlite_url"))
        yield engine
        engine.dispose()
    else:
        engine = request.getfixturevalue("pg_engine")
        try:
            yield engine
        finally:
            empty_tables(engine)
