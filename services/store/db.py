"""Engines and sessions for the store, on PostgreSQL (production) or SQLite (embedded).

``create_db_engine(settings)`` makes the store's SQLAlchemy engine with what each
backend needs to be safe under several processes (API, workers, sweeper) writing
at once:

- PostgreSQL: a pre-pinged connection pool; row-level conditional updates do the
  coordination (see ``queries``).
- SQLite: WAL journal (readers never block the writer), foreign keys on, a busy
  timeout, and write transactions that take the write lock up front
  (``BEGIN IMMEDIATE``) at their first write — never at a read. Both halves matter.
  With SQLite's default deferred transactions, two connections that both read and
  then write deadlock on the lock upgrade and one fails at once with "database is
  locked" regardless of the busy timeout; taking the lock up front makes writers
  queue instead. But taking it at *every* transaction's start (reads included)
  lets a request hold the lock between two thread-pool hops of the API (the key
  check, then the route) while every pool thread waits on that lock: 50 concurrent
  submissions starved for the busy timeout and answered 500. So a statement that
  only reads runs in autocommit (its own WAL snapshot, like PostgreSQL's READ
  COMMITTED sees committed data per statement); the first statement that writes —
  or a ``SELECT … FOR UPDATE``, which SQLite cannot lock row by row — opens
  ``BEGIN IMMEDIATE``, and the transaction holds the lock only from there to its
  commit, inside one query function. SQLite is the single-machine default;
  anything bigger should use PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from services.store.settings import StoreSettings
from services.store.settings import settings as default_settings


def create_db_engine(settings: StoreSettings | None = None, *, url: str | None = None) -> Engine:
    """An engine for ``url`` (default: ``settings.database_url``) configured for its backend."""
    settings = settings or default_settings
    parsed = make_url(url or settings.database_url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, settings)
    if parsed.get_backend_name() == "postgresql":
        # Pre-pinged: after a server restart the first checkout of each dead pooled connection
        # reconnects instead of failing the request that drew it.
        return create_engine(parsed, pool_size=settings.pool_size, max_overflow=settings.max_overflow,
                             pool_timeout=settings.pool_timeout_s, pool_pre_ping=True, echo=settings.echo,
                             connect_args={"connect_timeout": settings.connect_timeout_s})
    raise ValueError(f"DATABASE_URL {parsed.render_as_string(hide_password=True)!r} names backend "
                     f"{parsed.get_backend_name()!r}; the store supports postgresql (psycopg 3) and sqlite")


def _sqlite_engine(url: Any, settings: StoreSettings) -> Engine:
    database = url.database
    if database and database != ":memory:" and not database.startswith("file:"):
        # The embedded default lives under ./runs, which a fresh checkout does not have.
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, echo=settings.echo,
                           connect_args={"timeout": settings.sqlite_busy_timeout_s, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide where transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(settings.sqlite_busy_timeout_s * 1000)}")
        cursor.close()

    @event.listens_for(engine, "before_cursor_execute")
    def _write_lock_at_first_write(_conn: Any, cursor: Any, statement: str, _params: Any, context: Any,
                                   _executemany: bool) -> None:
        if cursor.connection.in_transaction or not _takes_write_lock(statement, context):
            return
        cursor.execute("BEGIN IMMEDIATE")

    return engine


_NO_LOCK_PREFIXES = ("SELECT", "PRAGMA", "EXPLAIN", "BEGIN", "COMMIT", "ROLLBACK", "RELEASE", "END")


def _takes_write_lock(statement: str, context: Any) -> bool:
    """Whether ``statement``, run outside a transaction, must first take SQLite's write lock."""
    head = statement.lstrip()[:8].upper()
    if not head.startswith(_NO_LOCK_PREFIXES):
        return True  # INSERT, UPDATE, DELETE, DDL, SAVEPOINT, WITH … (maybe writing)
    compiled = getattr(context, "compiled", None)
    return head.startswith("SELECT") and getattr(getattr(compiled, "statement", None), "_for_update_arg",
                                                 None) is not None


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit, so a route can still serialise them."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that rolls back on error and is always closed (for scripts, the CLI and workers)."""
    session = factory()
    try:
        yield session
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
