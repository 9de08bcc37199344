"""Run the store's Alembic migrations from code (the CLI, tests, benchmarks).

The migration scripts live in ``migrations/`` at the repository root (beside
``alembic.ini``), which is where an editable install or a checkout has them.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from services.store.db import create_db_engine
from services.store.settings import settings as default_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"


class SchemaNotCurrent(RuntimeError):
    """The database's schema is not at the newest migration."""


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config for ``migrations/`` against ``database_url`` (default: ``DATABASE_URL``)."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic migrations not found at {MIGRATIONS_DIR}; the store's migrations ship "
                                "with the repository — run from a checkout or an editable install")
    config = Config(str(REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = database_url or default_settings.database_url
    return config


def upgrade(database_url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str | None = None, revision: str = "-1") -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check_current(database_url: str | None = None) -> None:
    """Raise ``SchemaNotCurrent`` (saying what to run) unless the database is at the newest migration."""
    url = database_url or default_settings.database_url
    engine = create_db_engine(url=url)
    try:
        current = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    if current != head:
        shown = engine.url.render_as_string(hide_password=True)
        raise SchemaNotCurrent(f"the database at {shown} is at migration {current or '(none: empty)'}, not "
                               f"{head}; run `evalforge db upgrade` (or `alembic upgrade head`) first")
