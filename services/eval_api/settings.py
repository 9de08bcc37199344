"""Settings of the evaluation API, from the environment (documented defaults below).

The database is the store's setting (``DATABASE_URL``, see
``services/store/settings.py``), the broker and the queue are the queue's
(``REDIS_URL``, see ``services/queue.py``); everything the HTTP service itself
decides is here.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    """``EVALFORGE_*`` variables that configure ``evalforge api``."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_", populate_by_name=True, extra="ignore")

    reads_need_key: bool = Field(False, description="Require an API key for GET requests too (writes always do).")
    max_episodes_per_evaluation: int = Field(
        10_000, ge=1, description="Refuse evaluations with more episodes (tasks × episodes_per_task) than this.")
    max_queued_episodes: int = Field(
        100_000, ge=1, description=(
            "Refuse (429) a submission that would take the episodes waiting to run (`pending`, over all "
            "evaluations) past this."))
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="Refuse request bodies larger than this (413).")
    max_page_size: int = Field(500, ge=1, description="Largest `limit` a listing accepts.")
    policy_handshake_timeout_s: float = Field(
        10.0, gt=0, description="How long POST /policies waits for the policy server's handshake.")
    max_concurrent_registrations: int = Field(
        32, ge=1, description="How many POST /policies handshakes run at once; more wait for a free slot.")
    registration_wait_s: float = Field(
        30.0, ge=0, description=("How long a POST /policies waits for a free handshake slot before it is "
                                 "answered 503 with Retry-After."))
    artifact_root: Path = Field(Path("runs/artifacts"), validation_alias="ARTIFACT_ROOT", description=(
        "The workers' ARTIFACT_ROOT as this host sees it: the evaluation page serves replay GIFs from it."))
    worker_timeout_s: float = Field(45.0, gt=0, description=(
        "A worker whose last heartbeat is older than this is not live (keep it a few times the workers' "
        "EVALFORGE_POOL_HEARTBEAT_S)."))


settings = ApiSettings()
"""The process-wide API settings, read once from the environment at import."""
