"""The Celery tasks ``evalforge.run_episode(episode_id)`` and ``evalforge.run_episodes(episode_ids)``:
thin, as the Celery guide recommends.

They take an episode id, or a batch of them (``EVALFORGE_EPISODES_PER_MESSAGE`` > 1 on the
producer, ``services/queue.py``), and everything else — claiming, playing, recording,
finalising — is ``services.workers.runner.run_episode_by_id`` / ``run_episode_batch``, plain
functions the tests call directly. One-id messages (the default, and what an older API sends)
keep the per-episode path. The task is idempotent: a duplicate or redelivered message for
an episode that is finished, cancelled or held by a live worker is a no-op (the
claim is a conditional update), so Celery's at-least-once delivery is safe.

Time limits: each episode's own limit, from its row's ``max_steps``, is enforced by
the runner inside its loop (``runner.episode_time_limit``: checked every step, the
episode fails cleanly with a message saying where the time went). The task's Celery
limits are the process-wide last resort, for a call that never returns (a simulator
hung in C code): the soft limit is the runner's limit for the longest step limit of
any registered suite plus a minute; at the soft limit the episode is recorded as
``worker_lost`` with a message that says so (it is the harness's fault, not the
policy's). The hard limit, a minute later, kills the pool process; the message then
goes back to the queue and the lease expires, so the sweeper retries or closes it.
A batch task's limits are those × ``BATCH_LIMIT_EPISODES`` (the prefork pool can only limit
a whole task); at its soft limit the episode playing is recorded ``worker_lost`` and the
batch's other episodes keep their leases, which expire for the sweeper. With episodes in
flight (the threads pool) the watchdog times each episode of a batch on its own
(``services/workers/inflight.py``).
The API publishes bare episode ids without per-message limits: the worker reads each
episode's step limit from its row, so producers need not know it.
"""

from __future__ import annotations

import logging
import os
import socket

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.orm import Session, sessionmaker

from benchmarks.registry import get_suite, list_suites
from services.queue import RUN_EPISODE_TASK, RUN_EPISODES_TASK
from services.queue import settings as queue_settings
from services.store.models import FailureReason
from services.workers import runner
from services.workers.celery_app import app
from services.workers.settings import WorkerSettings
from services.workers.settings import settings as worker_settings

log = logging.getLogger("evalforge.workers.tasks")


def time_limits(settings: WorkerSettings) -> tuple[float, float]:
    """(soft, hard) process-wide seconds for one episode task: a minute past the runner's own
    per-episode limit for the suites' longest step limit, then another minute."""
    longest = max(spec.max_steps for name in list_suites() for spec in get_suite(name).tasks)
    soft = runner.episode_time_limit(longest, settings) + 60.0
    return soft, soft + 60.0


SOFT_TIME_LIMIT_S, TIME_LIMIT_S = time_limits(worker_settings)
BATCH_LIMIT_EPISODES = max(queue_settings.episodes_per_message, 32)
"""Episodes a batch task's process-wide limits allow for (prefork pool)."""

_sessions: tuple[int, sessionmaker[Session]] | None = None


def session_factory() -> sessionmaker[Session]:
    """This process's session factory, made on first use (after the prefork pool forked)."""
    global _sessions
    if _sessions is None or _sessions[0] != os.getpid():
        from services.store.db import create_db_engine, make_session_factory

        _sessions = (os.getpid(), make_session_factory(create_db_engine()))
    return _sessions[1]


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _record_soft_limit(episode_id: int, soft_s: float) -> None:
    runner.fail_episode(session_factory(), episode_id, FailureReason.WORKER_LOST,
                        f"the episode ran past the worker's process-wide soft time limit of {soft_s:.0f} s: a "
                        "simulator or policy call never returned (raise EVALFORGE_SECONDS_PER_STEP if the simulator "
                        "or policy is really this slow)")


def _log(result: runner.RunResult) -> None:
    log.info("episode %d: %s %s%s", result.episode_id, result.status, result.failure_reason or "",
             " (evaluation finalised)" if result.finalised else "")


@app.task(name=RUN_EPISODE_TASK, soft_time_limit=SOFT_TIME_LIMIT_S, time_limit=TIME_LIMIT_S)
def run_episode(episode_id: int) -> str:
    """Run stored episode ``episode_id`` (see ``runner.run_episode_by_id``); returns what happened."""
    try:
        result = runner.run_episode_by_id(session_factory(), int(episode_id), worker_id(), worker_settings)
    except SoftTimeLimitExceeded:
        _record_soft_limit(int(episode_id), SOFT_TIME_LIMIT_S)
        return "failed"
    _log(result)
    return result.status


@app.task(name=RUN_EPISODES_TASK, bind=True, soft_time_limit=SOFT_TIME_LIMIT_S * BATCH_LIMIT_EPISODES,
          time_limit=SOFT_TIME_LIMIT_S * BATCH_LIMIT_EPISODES + 60.0)
def run_episodes(self, episode_ids: list[int]) -> list[str]:  # noqa: ANN001 - Celery's bound task
    """Run the stored episodes ``episode_ids``, a batch (see ``runner.run_episode_batch``); returns what
    happened to each."""
    from services.workers import inflight

    task_id = self.request.id
    try:
        results = runner.run_episode_batch(session_factory(), [int(i) for i in episode_ids], worker_id(),
                                           worker_settings, on_start=lambda i: inflight.track_episode(task_id, i))
    except SoftTimeLimitExceeded as exc:
        episode_id = getattr(exc, "episode_id", None)
        if episode_id is not None:
            _record_soft_limit(episode_id, SOFT_TIME_LIMIT_S * BATCH_LIMIT_EPISODES)
        return ["failed"]
    for result in results:
        _log(result)
    return [result.status for result in results]
