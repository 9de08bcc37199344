"""Running one stored episode: the plain function behind the ``evalforge.run_episode`` task.

``run_episode_by_id(session_factory, episode_id, worker_id, settings)``:

1. claims the row (``queries.claim_episode``: a conditional update; a finished,
   cancelled or someone else's episode is left alone — that is what makes a
   redelivered message harmless);
2. builds the simulator from ``benchmarks`` for the episode's task, seed and step
   limit (one simulator per task is kept per worker process and reset per episode);
3. plays it with ``benchmarks.runner.run_episode`` through an ``ActionChunkBroker`` on
   a ``PolicyClient`` for the policy's endpoint (one client per endpoint per worker
   process), extending the lease every ``heartbeat_s`` seconds;
4. when the policy server is unreachable or times out, restarts the episode from its
   seed after an exponential, fully jittered backoff, up to ``policy_retries`` times;
   then the episode fails with ``policy_timeout`` (or ``policy_error`` when the
   server kept answering with errors). A simulator exception fails it with
   ``env_error`` at once (it would fail again); the worker goes on;
5. writes the result once (``queries.finish_episode``) and finalises the evaluation
   if that was its last live episode (``queries.finalize_evaluation_if_done``, which
   closes it exactly once however many workers race).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from websockets.exceptions import WebSocketException

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_episode
from benchmarks.suite import EpisodeEnv
from services.protocol.client import (
    ActionChunkBroker,
    ClientSettings,
    PolicyClient,
    PolicyError,
    PolicyTimeout,
    PolicyUnavailable,
    ProtocolError,
)
from services.protocol.messages import ErrorCode
from services.store import queries
from services.store.models import Episode, EpisodeStatus, Evaluation, FailureReason, Policy
from services.workers.settings import WorkerSettings

log = logging.getLogger("evalforge.workers.runner")

# Error replies worth retrying: the server is busy or going away, not refusing the request.
_TRANSIENT_CODES = {ErrorCode.OVERLOADED.value, ErrorCode.SHUTTING_DOWN.value, ErrorCode.INTERNAL.value}


@dataclass(frozen=True, slots=True)
class RunResult:
    """What ``run_episode_by_id`` did with an episode.

    ``status``: ``succeeded`` / ``failed`` (a result was written by this call),
    ``skipped`` (not claimable: finished, cancelled, or running elsewhere),
    ``lost`` (this call marked it ``worker_lost``: no attempts left),
    ``superseded`` (the lease went to another worker, or the row was closed, while running).
    """

    episode_id: int
    status: str
    failure_reason: str | None = None
    attempts: int = 0
    finalised: bool = False
    detail: str = ""


class LeaseLost(RuntimeError):
    """The episode is no longer this worker's (its lease was taken over, or it was closed)."""


class _PolicyRetryable(Exception):
    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------- per-process caches

_clients: dict[str, PolicyClient] = {}
_envs: dict[tuple[str, str], EpisodeEnv] = {}
_cache_pid = os.getpid()


def _check_fork() -> None:
    """A forked child must not share its parent's sockets or simulators."""
    global _cache_pid
    if os.getpid() != _cache_pid:
        _clients.clear()
        _envs.clear()
        _cache_pid = os.getpid()


def policy_client(endpoint: str, settings: WorkerSettings) -> PolicyClient:
    """This process's client for ``endpoint`` (connected lazily, on the first call)."""
    _check_fork()
    client = _clients.get(endpoint)
    if client is None:
        client = PolicyClient(endpoint, ClientSettings(connect_deadline_s=settings.policy_connect_deadline_s,
                                                       call_timeout_s=settings.policy_call_timeout_s))
        _clients[endpoint] = client
    return client


def _environment(suite_name: str, task: str, seed: int) -> EpisodeEnv:
    _check_fork()
    key = (suite_name, task)
    env = _envs.get(key)
    if env is None:
        env = get_suite(suite_name).make_env(task, seed)
        _envs[key] = env
    return env


def _drop_environment(suite_name: str, task: str) -> None:
    env = _envs.pop((suite_name, task), None)
    if env is not None:
        try:
            env.close()
        except Exception:  # a broken simulator may also fail to close; it is dropped either way
            log.debug("closing a failed %s/%s environment raised", suite_name, task, exc_info=True)


def close_caches() -> None:
    """Close every cached client and simulator (at worker shutdown, and in tests)."""
    for client in _clients.values():
        client.close()
    _clients.clear()
    for suite_name, task in list(_envs):
        _drop_environment(suite_name, task)


# ---------------------------------------------------------------------------- the runner


@dataclass(frozen=True, slots=True)
class _Job:
    episode_id: int
    evaluation_id: int
    suite: str
    task: str
    seed: int
    max_steps: int
    endpoint: str
    attempts: int


def _load_job(session: Session, episode_id: int) -> _Job:
    row = session.execute(
        select(Episode.evaluation_id, Evaluation.suite, Episode.task, Episode.seed, Episode.max_steps,
               Policy.endpoint, Episode.attempts)
        .join(Evaluation, Evaluation.id == Episode.evaluation_id)
        .join(Policy, Policy.id == Evaluation.policy_id)
        .where(Episode.id == episode_id)).one()
    session.rollback()
    return _Job(episode_id, *row)


def _why_not_claimed(session_factory: sessionmaker[Session], episode_id: int,
                     settings: WorkerSettings) -> RunResult:
    with session_factory() as session:
        episode = session.get(Episode, episode_id)
        if episode is None:
            return RunResult(episode_id, "skipped", detail=f"no episode with id {episode_id} (deleted?)")
        status, attempts, evaluation_id = episode.status, episode.attempts, episode.evaluation_id
        session.rollback()
        if status == EpisodeStatus.RUNNING and attempts >= settings.max_attempts:
            # Its lease may have expired with no attempts left: close it here rather than wait for the sweeper.
            touched = queries.mark_lost_episodes(session, max_attempts=settings.max_attempts,
                                                 episode_id=episode_id)
            if touched:
                finalised = queries.finalize_evaluation_if_done(session, evaluation_id)
                return RunResult(episode_id, "lost", FailureReason.WORKER_LOST.value, attempts, finalised,
                                 f"lease expired after {attempts} attempts")
    return RunResult(episode_id, "skipped", attempts=attempts, detail=f"episode is {status}, not claimable")


def _backoff(settings: WorkerSettings, retry: int, rng: random.Random) -> float:
    return rng.uniform(0.0, min(settings.policy_backoff_max_s, settings.policy_backoff_s * 2 ** retry))


def run_episode_by_id(session_factory: sessionmaker[Session], episode_id: int, worker_id: str,
                      settings: WorkerSettings, *, sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Claim, play and record stored episode ``episode_id``; safe to call again for the same id."""
    with session_factory() as session:
        claimed = queries.claim_episode(session, episode_id, worker_id, settings.lease_s,
                                        max_attempts=settings.max_attempts)
    if not claimed:
        return _why_not_claimed(session_factory, episode_id, settings)
    with session_factory() as session:
        job = _load_job(session, episode_id)

    last_beat = time.monotonic()

    def heartbeat(_step: int = 0) -> None:
        nonlocal last_beat
        if time.monotonic() - last_beat < settings.heartbeat_s:
            return
        with session_factory() as session:
            if not queries.extend_lease(session, episode_id, worker_id, settings.lease_s):
                raise LeaseLost(f"episode {episode_id} is no longer held by {worker_id}")
        last_beat = time.monotonic()

    result: dict = {}
    reason: FailureReason | None = None
    message: str | None = None
    rng = random.Random()
    try:
        for retry in range(settings.policy_retries + 1):
            try:
                result = _play(job, settings, heartbeat)
                reason, message = None, None
                break
            except _PolicyRetryable as exc:
                reason, message = exc.reason, f"{exc} (after {retry + 1} tries)"
                if retry == settings.policy_retries:
                    break
                delay = _backoff(settings, retry, rng)
                log.warning("episode %d: %s; retrying in %.1f s (%d/%d)", episode_id, exc, delay, retry + 1,
                            settings.policy_retries)
                deadline = time.monotonic() + delay
                while (left := deadline - time.monotonic()) > 0:
                    sleep(min(left, settings.heartbeat_s))
                    heartbeat()
    except LeaseLost as exc:
        log.warning("%s; dropping it", exc)
        return RunResult(episode_id, "superseded", attempts=job.attempts, detail=str(exc))
    except EnvFailure as exc:
        if isinstance(exc.__cause__, SoftTimeLimitExceeded):
            raise exc.__cause__ from None  # the task's time limit, not the simulator
        reason, message = FailureReason.ENV_ERROR, str(exc)
        _drop_environment(job.suite, job.task)
    except (PolicyError, ProtocolError, ValueError) as exc:
        # Deterministic refusals (unknown task, malformed actions): retrying would fail the same way.
        reason, message = FailureReason.POLICY_ERROR, f"{type(exc).__name__}: {exc}"

    with session_factory() as session:
        written = queries.finish_episode(
            session, episode_id, success=bool(result.get("success")) and reason is None,
            total_return=result.get("total_return"), steps=result.get("steps"),
            duration_s=result.get("duration_s"), latency_mean_ms=result.get("latency_mean_ms"),
            latency_p95_ms=result.get("latency_p95_ms"), failure_reason=reason,
            error_message=message[:2000] if message else None)
        finalised = queries.finalize_evaluation_if_done(session, job.evaluation_id)
    if not written:
        return RunResult(episode_id, "superseded", attempts=job.attempts, finalised=finalised,
                         detail="the episode was closed by someone else meanwhile")
    ok = bool(result.get("success")) and reason is None
    return RunResult(episode_id, "succeeded" if ok else "failed", reason.value if reason else None,
                     job.attempts, finalised, message or "")


def fail_episode(session_factory: sessionmaker[Session], episode_id: int, reason: FailureReason,
                 message: str) -> bool:
    """Close a live episode as failed for ``reason`` (e.g. its task hit the time limit) and finalise
    its evaluation if that was the last; False when it was already terminal."""
    with session_factory() as session:
        episode = session.get(Episode, episode_id)
        if episode is None:
            return False
        evaluation_id = episode.evaluation_id
        session.rollback()
        written = queries.finish_episode(session, episode_id, success=False, failure_reason=reason,
                                         error_message=message)
        queries.finalize_evaluation_if_done(session, evaluation_id)
    return written


def _play(job: _Job, settings: WorkerSettings, heartbeat: Callable[[int], None]) -> dict:
    """One try at the episode; policy-server trouble is raised as ``_PolicyRetryable``."""
    env = _environment(job.suite, job.task, job.seed)
    env.max_steps = job.max_steps
    client = policy_client(job.endpoint, settings)
    broker = ActionChunkBroker(client, episode_id=f"episode-{job.episode_id}-{job.attempts}")
    try:
        outcome = run_episode(env, broker.act, seed=job.seed, on_step=heartbeat)
    except (PolicyUnavailable, PolicyTimeout, OSError, EOFError, WebSocketException) as exc:
        client.close()
        raise _PolicyRetryable(FailureReason.POLICY_TIMEOUT, f"policy server {job.endpoint}: {exc}") from exc
    except PolicyError as exc:
        if exc.code not in _TRANSIENT_CODES:
            raise
        client.close()
        raise _PolicyRetryable(FailureReason.POLICY_ERROR, f"policy server {job.endpoint}: {exc}") from exc
    latencies = np.asarray(broker.latencies_s) * 1e3
    return {"success": outcome.success, "total_return": outcome.total_reward, "steps": outcome.steps,
            "duration_s": outcome.duration_s,
            "latency_mean_ms": float(latencies.mean()) if len(latencies) else None,
            "latency_p95_ms": float(np.percentile(latencies, 95)) if len(latencies) else None}
