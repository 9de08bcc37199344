"""Settings of the Celery workers, from the environment (documented defaults below)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    """``REDIS_URL`` and ``EVALFORGE_*`` variables that configure the Celery app and its workers."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_", populate_by_name=True, extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL",
                           description="Redis, the Celery broker.")
    broker_url: str | None = Field(
        None, description="Celery broker URL when it is not REDIS_URL (e.g. an embedded transport).")
    episode_queue: str = Field("episodes", description="Queue the episode tasks are consumed from.")
    visibility_timeout_s: int = Field(
        3600, ge=60, description=("Redis: an unacknowledged task is redelivered after this long. Must exceed the "
                                  "longest episode, or a slow episode is run twice (harmless, but wasted)."))

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url


settings = WorkerSettings()
"""The process-wide worker settings, read once from the environment at import."""
