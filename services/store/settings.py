"""Settings of the results store: where the database is and how connections are pooled.

Read from the environment (``DATABASE_URL`` and ``EVALFORGE_DB_*``). The default is
the embedded one — a SQLite file under ``./runs`` — so a single machine needs no
server; production points ``DATABASE_URL`` at PostgreSQL
(``postgresql+psycopg://user@host/db``; plain ``postgresql://`` and ``postgres://``
are accepted and mean psycopg 3).
"""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite:///./runs/evalforge.db"


class StoreSettings(BaseSettings):
    """Connection settings shared by everything that opens the store (API, workers, CLI, Alembic)."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_DB_", populate_by_name=True, extra="ignore")

    database_url: str = Field(
        DEFAULT_DATABASE_URL, validation_alias="DATABASE_URL",
        description="SQLAlchemy URL of the store. SQLite (embedded, one machine) or PostgreSQL (psycopg 3).")
    pool_size: int = Field(10, ge=1, description="PostgreSQL: connections kept open per process.")
    max_overflow: int = Field(20, ge=0, description="PostgreSQL: extra connections allowed under bursts.")
    pool_timeout_s: float = Field(10.0, gt=0, description="PostgreSQL: wait this long for a free connection.")
    connect_timeout_s: int = Field(5, ge=1, description=(
        "PostgreSQL: give up connecting after this many seconds (a server that is down or unreachable "
        "answers the API's requests with a 503 within this time, not a hang)."))
    sqlite_busy_timeout_s: float = Field(
        30.0, gt=0, description="SQLite: how long a writer waits for the file lock before failing.")
    echo: bool = Field(False, description="Log every SQL statement (debugging).")
    inline_episodes: int = Field(10_000, ge=1, validation_alias="EVALFORGE_INLINE_EPISODES", description=(
        "An evaluation of up to this many episodes is created with all its episode rows in the request; a "
        "larger one is stored as its plan, answered 202, and its rows written after the response."))
    materialize_chunk: int = Field(10_000, ge=1, validation_alias="EVALFORGE_MATERIALIZE_CHUNK", description=(
        "Episode rows per transaction when a large evaluation's rows are written after its 202 (each chunk is "
        "enqueued after its commit)."))

    @field_validator("database_url")
    @classmethod
    def _normalise_url(cls, url: str) -> str:
        return normalise_database_url(url)


def normalise_database_url(url: str) -> str:
    """``postgres://`` / ``postgresql://`` → ``postgresql+psycopg://`` (psycopg 3 is the driver installed)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


settings = StoreSettings()
"""The process-wide store settings, read once from the environment at import."""
