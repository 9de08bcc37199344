"""Fixtures of the store tests: scratch databases on PostgreSQL and SQLite (see ``databases``)."""

from tests.store.databases import (  # noqa: F401  (fixtures)
    pg_database,
    pg_engine,
    sqlite_template,
    sqlite_url,
    store_engine,
)
