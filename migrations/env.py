"""Alembic environment for the EvalForge store.

The URL is, in order: ``config.attributes["database_url"]`` (set by
``services.store.migrate`` and the tests), else ``DATABASE_URL`` through
``StoreSettings``. SQLite runs in batch mode, because its ALTER TABLE cannot change
columns or constraints in place: batch mode rebuilds the table (copy, drop, rename), so
its foreign keys are switched off while migrations run and checked after
(``PRAGMA foreign_key_check``), as SQLite's own procedure for such changes prescribes —
with them on, dropping the old ``evaluations`` would cascade-delete every episode. The models' metadata is the autogenerate target,
so ``alembic check`` (and a test) catch a model change without a migration.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from services.store.db import create_db_engine
from services.store.models import Base
from services.store.settings import StoreSettings, normalise_database_url

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    url = config.attributes.get("database_url")
    return normalise_database_url(url) if url else StoreSettings().database_url


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    backend = connection.dialect.name if connection is not None else (url or "").split(":", 1)[0]
    context.configure(connection=connection, url=url, target_metadata=target_metadata,
                      render_as_batch=backend.startswith("sqlite"), compare_type=True)


def run_migrations_offline() -> None:
    """Emit SQL to stdout (``alembic upgrade head --sql``) without a database."""
    _configure(url=_database_url())
    with context.begin_transaction():
        context.run_migrations()


def _run_online(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:  # a no-op inside a transaction: set before alembic begins one
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()
    try:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration left rows whose foreign keys point nowhere: {broken[:5]}")
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_online(connection)
        return
    engine = create_db_engine(url=_database_url())
    try:
        with engine.connect() as connection:
            _run_online(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
