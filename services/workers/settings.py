"""Settings of the Celery workers, from the environment (documented defaults below).

The broker, the queue name and Redis's visibility timeout are the queue's settings
(``services/queue.py``), which the API reads too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    """``EVALFORGE_*`` variables that configure the workers: leases, retries, replays, the sweeper."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_", populate_by_name=True, extra="ignore")

    # Episodes: leases, attempts, retries against the policy server.
    lease_s: float = Field(60.0, gt=0, description=(
        "A claimed episode is presumed lost (its worker dead) this long after the last heartbeat."))
    heartbeat_s: float = Field(15.0, gt=0, description="How often a running episode extends its lease.")
    max_attempts: int = Field(3, ge=1, description=(
        "Claims of one episode before an expired lease marks it `worker_lost` instead of running it again."))
    policy_retries: int = Field(3, ge=0, description=(
        "Restarts of an episode after the policy server was unreachable or timed out, before it fails."))
    policy_backoff_s: float = Field(1.0, ge=0, description="First retry delay (doubles, full jitter).")
    policy_backoff_max_s: float = Field(15.0, ge=0, description="Longest retry delay.")
    policy_connect_deadline_s: float = Field(10.0, gt=0, description="Budget to (re)connect to a policy server.")
    policy_call_timeout_s: float = Field(30.0, gt=0, description="Budget for one inference call.")
    seconds_per_step: float = Field(0.5, gt=0, description=(
        "Time budget per simulator step: an episode fails once it has run longer than its own max steps × "
        "this + the policy-retry budget (checked every step)."))
    # Replays.
    replay_episodes: int = Field(3, ge=0, description=(
        "Record a replay GIF of the first N episodes of each evaluation (by episode index); 0 turns replays "
        "off. Costs ~10-20 ms of software rendering per frame on a CPU host."))
    replay_every: int = Field(2, ge=1, description="Steps between two replay frames.")
    replay_camera: Literal["policy", "overview"] = Field("policy", description=(
        "What replays show: `policy`, what the policy saw (of the evaluation's cameras, the one the suite lists first, at its size; the "
        "overview for a state-only policy), or `overview`, the suite's overview camera at 160×120."))
    artifact_root: Path = Field(Path("runs/artifacts"), validation_alias="ARTIFACT_ROOT", description=(
        "Directory replay GIFs are written under (episode rows keep paths relative to it)."))
    # Pools.
    pool_heartbeat_s: float = Field(10.0, gt=0, description=(
        "How often a worker refreshes its row in the store (its simulators, that it is alive)."))
    # The sweeper.
    pending_after_s: float = Field(300.0, gt=0, description=(
        "A `pending` episode this old is re-enqueued (its broker message may have been lost)."))
    sweep_every_s: float = Field(30.0, gt=0, description="Seconds between two sweeps.")
    # The store restarting.
    store_retry_s: float = Field(300.0, ge=0, description=(
        "How long a worker keeps an episode's result and retries writing it while the database is unreachable "
        "(then the lease expires and the sweeper runs the episode again)."))


settings = WorkerSettings()
"""The process-wide worker settings, read once from the environment at import."""
