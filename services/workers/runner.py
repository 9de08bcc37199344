"""Running one stored episode: the plain function behind the ``evalforge.run_episode`` task.

``run_episode_by_id(session_factory, episode_id, worker_id, settings)``:

1. claims the row (``queries.claim_episode``: a conditional update; a finished,
   cancelled or someone else's episode is left alone — that is what makes a
   redelivered message harmless); in an evaluation already running, on PostgreSQL, the
   claim and the read of the job are one statement (``queries.claim_running_episode``);
2. builds the simulator from ``benchmarks`` for the episode's task, seed and step
   limit (one simulator per task is kept per worker process and reset per episode);
3. plays it with ``benchmarks.runner.run_policy_episode`` through an ``ActionChunkBroker`` on
   a ``PolicyClient`` for the policy's endpoint (one client per endpoint per worker
   process), rendering the evaluation's cameras at the steps the broker asks the server
   for actions (``services/workers/cameras.py``), extending the lease every ``heartbeat_s`` seconds, and recording replay
   frames when the episode is one of its evaluation's first ``replay_episodes``
   (``services/workers/replays.py``);
   Before it connects, the endpoint is checked against ``EVALFORGE_POLICY_HOSTS``
   (``services.policy_hosts``; outside it the episode fails ``endpoint_refused``), and
   at every connection the server's handshake must name the checkpoint the policy was
   registered with (``expected_checkpoint``); another one fails the episode with
   ``checkpoint_mismatch`` and a message naming both, so a server swapped behind an
   endpoint is never scored as the registered policy. Both are harness failures, left
   out of success rates, and neither is retried;
4. when the policy server is unreachable or times out, restarts the episode from its
   seed — at once on another replica where the policy has several endpoints and one is
   healthy (``services/workers/replicas.py``: least in flight first, fail over, probe
   the lost one again later), else after an exponential, fully jittered backoff, up to
   ``policy_retries`` times;
   then the episode fails with ``policy_timeout`` (or ``policy_error`` when the
   server kept answering with errors). A simulator exception fails it with
   ``env_error`` at once (it would fail again); the worker goes on;
5. writes the result once — kept and retried while the store is unreachable, as the
   claim is (``services/workers/store_retry.py``) — (``queries.finish_episode``, with the replay GIF's path if
   one was recorded, the simulator packages' versions it ran with, its renderer
   (``renderer``: for MuJoCo simulators ``MUJOCO_GL``, the OpenGL backend its frames were
   rendered with) and this worker's host name) and finalises the evaluation if that was its last live episode
   (``queries.finalize_evaluation_if_done``, which closes it exactly once however many
   workers race). The claim and the result each use one pooled connection for all their
   statements (``_one_connection``: one checkout and pre-ping each, not one per transaction).

Time limit: each episode gets its own, from its row's step limit —
``episode_time_limit(max_steps) = max_steps × seconds_per_step + retry budget`` (the
time its policy-server reconnects and backoffs may take), counted from the first reset
(building the simulator, once per worker process, is not the episode's time) and
checked after every step. An episode past it fails cleanly: ``policy_timeout`` when
most of the time went to waiting for the policy server, ``env_error`` (a harness
failure, left out of success rates) when it went to the simulator or the worker; the
message says where the time went. A 150-step task thus gets 75 s at the default
0.5 s a step, not the budget of a 500-step one. Only a call that never returns (a
simulator hung in C code) escapes this check; the Celery task's process-wide soft and
hard limits (``services/workers/tasks.py``) are the last resort for that.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, ValuesView
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from websockets.exceptions import WebSocketException

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_policy_episode
from benchmarks.simulators import simulator_versions
from benchmarks.suite import EpisodeEnv
from services.policy_hosts import EndpointRefused, check_endpoint
from services.protocol.adapters import PolicyAdapter, make_client
from services.protocol.client import (
    CheckpointMismatch,
    ClientSettings,
    PolicyError,
    PolicyTimeout,
    PolicyUnavailable,
    ProtocolError,
    backoff_delays,
    latency_summary_ms,
)
from services.protocol.ensemble import make_broker
from services.protocol.messages import ErrorCode
from services.store import batches, queries
from services.store.models import (
    Episode,
    EpisodeStatus,
    Evaluation,
    FailureReason,
    Policy,
    PolicyProtocol,
    utcnow,
)
from services.workers import recording
from services.workers.cameras import observing_policy
from services.workers.replays import ReplayRecorder, replay_camera, save_replay
from services.workers.replicas import play_on_replicas, policy_endpoints
from services.workers.settings import WorkerSettings
from services.workers.store_retry import is_store_outage, retry_while_store_down

log = logging.getLogger("evalforge.workers.runner")

# Error replies worth retrying: the server is busy or going away, not refusing the request.
_TRANSIENT_CODES = {ErrorCode.OVERLOADED.value, ErrorCode.SHUTTING_DOWN.value, ErrorCode.INTERNAL.value}


@dataclass(frozen=True, slots=True)
class RunResult:
    """What ``run_episode_by_id`` did with an episode.

    ``status``: ``succeeded`` / ``failed`` (a result was written by this call),
    ``skipped`` (not claimable: finished, cancelled, or running elsewhere),
    ``lost`` (this call marked it ``worker_lost``: no attempts left),
    ``superseded`` (the lease went to another worker, or the row was closed, while running),
    ``cancelled`` (a batch closed it unplayed: its evaluation was cancelled before the batch reached it).
    """

    episode_id: int
    status: str
    failure_reason: str | None = None
    attempts: int = 0
    finalised: bool = False
    detail: str = ""


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """What playing an episode measured, as ``queries.finish_episode`` records it.

    The default is an episode that measured nothing (it failed before it ran); one that
    ran out of time keeps its steps and duration.
    """

    success: bool = False
    total_return: float | None = None
    steps: int | None = None
    duration_s: float | None = None
    latency_mean_ms: float | None = None
    latency_p95_ms: float | None = None


class LeaseLost(RuntimeError):
    """The episode is no longer this worker's (its lease was taken over, or it was closed)."""


class _PolicyRetryable(Exception):
    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _OutOfTime(Exception):
    """The episode's deadline passed (raised from the per-step hook, so it leaves the loop at once)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"out of time at step {step}")
        self.step = step
        self.policy_s = 0.0  # time this try spent waiting for the policy server
        self.try_s = 0.0  # time this try ran


@dataclass
class _EpisodeClock:
    """An episode's time limit, counted from when its simulator is ready on the first try:
    importing MuJoCo and building a simulator is a once-per-process cost, not the episode's."""

    limit_s: float
    started: float | None = None

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def left(self) -> float:
        return self.limit_s - self.elapsed()


def retry_budget_s(settings: WorkerSettings) -> float:
    """The longest an episode may spend connecting to the policy server and backing off between tries."""
    return ((settings.policy_retries + 1) * settings.policy_connect_deadline_s
            + settings.policy_retries * settings.policy_backoff_max_s)


def episode_time_limit(max_steps: int, settings: WorkerSettings) -> float:
    """Seconds an episode of ``max_steps`` steps may run, from its first reset to its last step."""
    return max_steps * settings.seconds_per_step + retry_budget_s(settings)


# ---------------------------------------------------------------------------- per-process caches

class _PerThread:
    """A cache dict of the calling thread's own (one per thread, and a forked child starts empty).

    A worker with episodes in flight (``services/workers/inflight.py``) plays each episode in a
    thread of its own: a simulator or a policy client must never be shared by two threads, and
    a MuJoCo renderer's GL context stays in the thread that made it."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._every: list[dict] = []

    def mine(self) -> dict:
        cache = getattr(self._local, "cache", None)
        if cache is None or self._local.pid != os.getpid():
            cache = self._local.cache = {}
            self._local.pid = os.getpid()
            with self._lock:
                self._every.append(cache)
        return cache

    def every_thread(self) -> list[dict]:
        with self._lock:
            return list(self._every)

    def get(self, key: Any, default: Any = None) -> Any:
        return self.mine().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        return self.mine()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.mine()[key] = value

    def __contains__(self, key: Any) -> bool:
        return key in self.mine()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.mine())

    def pop(self, key: Any, default: Any = None) -> Any:
        return self.mine().pop(key, default)

    def values(self) -> ValuesView[Any]:
        return self.mine().values()

    def clear(self) -> None:
        self.mine().clear()


_clients = _PerThread()  # (endpoint, protocol, …) → PolicyAdapter, per thread
_envs = _PerThread()  # (suite, task) → EpisodeEnv, per thread
_cache_pid = os.getpid()


def _check_fork() -> None:
    """A forked child must not share its parent's sockets or simulators."""
    global _cache_pid
    if os.getpid() != _cache_pid:
        _clients.clear()
        _envs.clear()
        _cache_pid = os.getpid()


def _client_key(job: _Job) -> tuple:
    return (job.endpoint, job.protocol, job.checkpoint_sha256, job.action_dim,
            tuple(sorted((job.observation_keys or {}).items())))


def policy_client(job: _Job, settings: WorkerSettings) -> PolicyAdapter:
    """This process's client for the job's policy server, in its protocol (connected lazily, on the
    first call). For our servers every connection checks the checkpoint the policy was registered
    with; the other protocols' replies are checked against the action dimension."""
    _check_fork()
    key = _client_key(job)
    client = _clients.get(key)
    if client is None:
        client = make_client(job.protocol, job.endpoint,
                             ClientSettings(connect_deadline_s=settings.policy_connect_deadline_s,
                                            call_timeout_s=settings.policy_call_timeout_s),
                             observation_keys=job.observation_keys, expected_checkpoint=job.checkpoint_sha256,
                             action_dim=job.action_dim)
        _clients[key] = client
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
    """Close every cached client and simulator, of every thread (at worker shutdown, and in tests)."""
    for clients in _clients.every_thread():
        for client in list(clients.values()):
            client.close()
        clients.clear()
    for envs in _envs.every_thread():
        for (suite_name, task), env in list(envs.items()):
            envs.pop((suite_name, task), None)
            try:
                env.close()
            except Exception:  # a broken simulator may also fail to close; it is dropped either way
                log.debug("closing a failed %s/%s environment raised", suite_name, task, exc_info=True)


# ---------------------------------------------------------------------------- the runner


@dataclass(frozen=True, slots=True)
class _Job:
    episode_id: int
    evaluation_id: int
    episode_index: int
    suite: str
    task: str
    seed: int
    max_steps: int
    endpoint: str
    attempts: int
    checkpoint_sha256: str | None
    cameras: dict[str, list[int]] | None
    protocol: str
    observation_keys: dict[str, str] | None
    action_dim: int
    inference: dict[str, Any]
    record: str = "none"  # the evaluation's RecordMode (services/workers/recording.py)
    episodes_per_task: int = 1


# What a worker reads of an episode, its evaluation and its policy to play it (the fields of _Job).
_JOB_COLUMNS = (Episode.evaluation_id, Episode.episode_index, Evaluation.suite, Episode.task, Episode.seed,
                Episode.max_steps, Policy.endpoint, Episode.attempts, Policy.checkpoint_sha256,
                Evaluation.cameras, Policy.protocol, Policy.observation_keys, Policy.action_dim,
                Evaluation.inference, Evaluation.record, Evaluation.episodes_per_task)


def _load_job(session: Session, episode_id: int) -> _Job:
    row = session.execute(
        select(*_JOB_COLUMNS)
        .join(Evaluation, Evaluation.id == Episode.evaluation_id)
        .join(Policy, Policy.id == Evaluation.policy_id)
        .where(Episode.id == episode_id)).one()
    session.rollback()
    return _job_from_row(episode_id, row)


def _job_from_row(episode_id: int, row: Any) -> _Job:
    *fields, action_dim, inference, record, episodes_per_task = row
    # A server that did not say its action dimension is held to the suite's.
    return _Job(episode_id, *fields, action_dim=action_dim or get_suite(fields[2]).action_dim,
                inference=inference or {}, record=record, episodes_per_task=episodes_per_task)


@contextmanager
def _one_connection(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that keeps one pooled connection across its commits: one checkout (and one
    pre-ping) for a claim or a result and what follows it, where a plain session gives its
    connection back at every commit and checks out (and pings) another for the next statement."""
    bind = session_factory.kw.get("bind")
    if not isinstance(bind, Engine):
        with session_factory() as session:
            yield session
        return
    with bind.connect() as connection, session_factory(bind=connection) as session:
        yield session


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


def run_episode_by_id(session_factory: sessionmaker[Session], episode_id: int, worker_id: str,
                      settings: WorkerSettings, *, sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Claim, play and record stored episode ``episode_id``; safe to call again for the same id."""
    def claim() -> _Job | None:
        with _one_connection(session_factory) as session:
            # Most claims: the claim and the job's read in one statement (PostgreSQL, a running evaluation).
            row = queries.claim_running_episode(session, episode_id, worker_id, settings.lease_s, _JOB_COLUMNS,
                                                max_attempts=settings.max_attempts)
            if row is not None:
                return _job_from_row(episode_id, row)
            # An evaluation's first claim (it marks it running), SQLite, or an episode not claimable.
            claimed = queries.claim_episode(session, episode_id, worker_id, settings.lease_s,
                                            max_attempts=settings.max_attempts)
            return _load_job(session, episode_id) if claimed else None

    # A store that is restarting: wait for it with the message unacknowledged, rather than drop the
    # message and leave the episode to the sweeper.
    job = retry_while_store_down(claim, what=f"claiming episode {episode_id}", budget_s=settings.store_retry_s,
                                 sleep=sleep)
    if job is None:
        return _why_not_claimed(session_factory, episode_id, settings)

    last_beat = time.monotonic()

    def heartbeat() -> None:
        nonlocal last_beat
        if time.monotonic() - last_beat < settings.heartbeat_s:
            return
        try:
            with session_factory() as session:
                held = queries.extend_lease(session, episode_id, worker_id, settings.lease_s)
        except Exception as exc:
            if not is_store_outage(exc):
                raise
            # The store is restarting: keep playing (the result is written once it is back); if the
            # lease expires meanwhile and another worker takes the episode, the next beat says so.
            log.warning("episode %d: heartbeat skipped, the store is unreachable (%s)", episode_id,
                        str(exc).splitlines()[0][:200])
            held = True
        if not held:
            raise LeaseLost(f"episode {episode_id} is no longer held by {worker_id}")
        last_beat = time.monotonic()

    played = _play_claimed(session_factory, job, settings, heartbeat, sleep)
    if isinstance(played, RunResult):
        return played
    family = get_suite(job.suite).simulator
    wrote: list[bool | None] = [None]  # finish_episode's answer, kept if finalising then fails

    def write_result() -> bool:
        with _one_connection(session_factory) as session:  # the result and the finalisation check
            if wrote[0] is None:
                wrote[0] = queries.finish_episode(
                    session, episode_id, success=played.succeeded, total_return=played.result.total_return,
                    steps=played.result.steps, duration_s=played.result.duration_s,
                    latency_mean_ms=played.result.latency_mean_ms, latency_p95_ms=played.result.latency_p95_ms,
                    failure_reason=played.reason, error_message=played.message[:2000] if played.message else None,
                    artifact_path=played.artifact_path, recording_path=played.recording_path,
                    simulator_versions=simulator_versions(family), renderer=renderer(family),
                    initial_state_index=_initial_state_index(job), worker_host=socket.gethostname())
            return queries.finalize_evaluation_if_done(session, job.evaluation_id)

    # A store that is restarting does not lose the episode: the result is written once it is back.
    finalised = retry_while_store_down(write_result, what=f"episode {episode_id}'s result",
                                       budget_s=settings.store_retry_s, sleep=sleep)
    if not wrote[0]:
        return RunResult(episode_id, "superseded", attempts=job.attempts, finalised=finalised,
                         detail="the episode was closed by someone else meanwhile")
    return played.run_result(job, finalised=finalised)


@dataclass(frozen=True, slots=True)
class _Played:
    """What playing a claimed episode came to, before its result is written."""

    result: EpisodeResult
    reason: FailureReason | None
    message: str | None
    artifact_path: str | None
    recording_path: str | None

    @property
    def succeeded(self) -> bool:
        return self.result.success and self.reason is None

    def run_result(self, job: _Job, *, finalised: bool) -> RunResult:
        return RunResult(job.episode_id, "succeeded" if self.succeeded else "failed",
                         self.reason.value if self.reason else None, job.attempts, finalised, self.message or "")


def _play_claimed(session_factory: sessionmaker[Session], job: _Job, settings: WorkerSettings,
                  heartbeat: Callable[[], None], sleep: Callable[[float], None],
                  check: Callable[[str], None] = check_endpoint) -> _Played | RunResult:
    """Play a claimed episode: its tries against the policy server, its time limit, its replay and
    recording; ``heartbeat()`` is called every step (it extends the lease when one is due, and raises
    ``LeaseLost`` when the episode is no longer this worker's: then a ``superseded`` ``RunResult``).
    ``check(endpoint)`` raises ``EndpointRefused`` for an endpoint ``EVALFORGE_POLICY_HOSTS`` refuses."""
    episode_id = job.episode_id
    clock = _EpisodeClock(episode_time_limit(job.max_steps, settings))

    def on_step(step: int) -> None:
        if clock.left() < 0:
            raise _OutOfTime(step)
        heartbeat()

    result = EpisodeResult()
    reason: FailureReason | None = None
    message: str | None = None
    delays = backoff_delays(settings.policy_backoff_s, settings.policy_backoff_max_s)
    recorders: list[ReplayRecorder] | None = [] if job.episode_index < settings.replay_episodes else None
    rollouts: list[recording.RolloutRecorder] | None = (
        [] if recording.is_recorded(job.record, job.episode_index, job.episodes_per_task) else None)
    try:
        check(job.endpoint)  # EVALFORGE_POLICY_HOSTS as it is now, not when the policy was registered
        for retry in range(settings.policy_retries + 1):
            try:
                # On the least busy healthy replica; a lost server fails over to the others at once
                # (services/workers/replicas.py), so only a try that lost every replica lands below.
                result = play_on_replicas(
                    policy_endpoints(session_factory, job.evaluation_id, job.endpoint),
                    lambda endpoint: _play(replace(job, endpoint=endpoint), settings, clock, on_step, recorders,
                                           rollouts), _PolicyRetryable,
                    down_s=settings.policy_backoff_s, max_down_s=settings.policy_backoff_max_s)
                reason, message = None, None
                break
            except _PolicyRetryable as exc:
                reason, message = exc.reason, f"{exc} (after {retry + 1} tries)"
                if retry == settings.policy_retries:
                    break
                delay = next(delays)
                if delay > clock.left():
                    message += f"; its time limit of {clock.limit_s:.1f} s leaves no room for another try"
                    break
                log.warning("episode %d: %s; retrying in %.1f s (%d/%d)", episode_id, exc, delay, retry + 1,
                            settings.policy_retries)
                wake = time.monotonic() + delay
                while (left := wake - time.monotonic()) > 0:
                    sleep(min(left, settings.heartbeat_s))
                    heartbeat()
    except _OutOfTime as exc:
        # Earlier tries and the backoffs after them were all policy-server trouble.
        elapsed_s = clock.elapsed()
        reason, message = _out_of_time(exc, job, settings, clock.limit_s, elapsed_s=elapsed_s,
                                       policy_s=elapsed_s - (exc.try_s - exc.policy_s))
        result = EpisodeResult(steps=exc.step, duration_s=exc.try_s)
        log.warning("episode %d: %s", episode_id, message)
    except LeaseLost as exc:
        log.warning("%s; dropping it", exc)
        return RunResult(episode_id, "superseded", attempts=job.attempts, detail=str(exc))
    except EnvFailure as exc:
        if isinstance(exc.__cause__, SoftTimeLimitExceeded):
            raise exc.__cause__ from None  # the task's time limit, not the simulator
        reason, message = FailureReason.ENV_ERROR, str(exc)
        _drop_environment(job.suite, job.task)
    except EndpointRefused as exc:
        reason, message = FailureReason.ENDPOINT_REFUSED, f"not connecting to {job.endpoint}: {exc}"
    except CheckpointMismatch as exc:
        client = _clients.pop(_client_key(replace(job, endpoint=getattr(exc, "endpoint", job.endpoint))), None)
        if client is not None:
            client.close()
        reason, message = FailureReason.CHECKPOINT_MISMATCH, str(exc)
    except (PolicyError, ProtocolError, ValueError) as exc:
        # Deterministic refusals (unknown task, malformed actions): retrying would fail the same way.
        reason, message = FailureReason.POLICY_ERROR, f"{type(exc).__name__}: {exc}"

    artifact_path = None
    if recorders:
        artifact_path = save_replay(recorders[-1], settings.artifact_root, job.evaluation_id, job.episode_index,
                                    fps=get_suite(job.suite).fps / settings.replay_every)
    recording_path = None
    if rollouts and recording.is_kept(job.record, success=result.success, failure_reason=reason):
        recording_path = recording.save_recording(rollouts[-1], settings.artifact_root, evaluation_id=job.evaluation_id,
                                                  episode_index=job.episode_index, seed=job.seed,
                                                  success=result.success)
    return _Played(result, reason, message, artifact_path, recording_path)


def renderer(family: str) -> str | None:
    """The renderer a simulator family's frames come from in this worker: ``MUJOCO_GL`` (``egl``,
    ``osmesa``, ``glfw``; ``benchmarks.rendering`` chooses it when the environment does not) for
    the MuJoCo families, whose frames differ between backends; None for the others."""
    if "mujoco" not in simulator_versions(family):
        return None
    return os.environ.get("MUJOCO_GL") or None


def _initial_state_index(job: _Job) -> int | None:
    """The fixed initial state the episode's seed picked, for suites that have a set of them (LIBERO)."""
    env = _envs.get((job.suite, job.task))
    index = getattr(env, "init_state_index", None) if env is not None and env.seed == job.seed else None
    return int(index) if index is not None else None


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
                                         error_message=message, worker_host=socket.gethostname())
        queries.finalize_evaluation_if_done(session, evaluation_id)
    return written


def _out_of_time(exc: _OutOfTime, job: _Job, settings: WorkerSettings, limit_s: float, *, elapsed_s: float,
                 policy_s: float) -> tuple[FailureReason, str]:
    """Whose fault the overrun is (where most of the time went) and a message saying so."""
    other_s = max(0.0, elapsed_s - policy_s)
    policy_bound = policy_s >= other_s
    where = (f"of its {elapsed_s:.2f} s, {policy_s:.2f} s went to the policy server {job.endpoint} (connecting, "
             f"inference, retries) and {other_s:.2f} s to building and stepping the simulator and the worker")
    fix = ("the policy server is too slow for this budget (serve it on faster hardware or with fewer clients)"
           if policy_bound else "the simulator or the worker host is too slow for this budget")
    return (FailureReason.POLICY_TIMEOUT if policy_bound else FailureReason.ENV_ERROR,
            f"the episode ran past its time limit of {limit_s:.1f} s ({job.max_steps} steps × "
            f"{settings.seconds_per_step:g} s per step + {retry_budget_s(settings):.1f} s for policy-server "
            f"retries) at step {exc.step}: {where}; {fix} — or raise EVALFORGE_SECONDS_PER_STEP")


def _play(job: _Job, settings: WorkerSettings, clock: _EpisodeClock, on_step: Callable[[int], None],
          recorders: list[ReplayRecorder] | None,
          rollouts: list[recording.RolloutRecorder] | None = None) -> EpisodeResult:
    """One try at the episode; policy-server trouble is raised as ``_PolicyRetryable``.

    With ``recorders`` (a list), a fresh ``ReplayRecorder`` for this try is appended to it:
    it grabs a frame before every ``replay_every``-th action and one of the final state.
    Likewise ``rollouts``: a ``RolloutRecorder`` keeps every step's state, action and camera frames.
    """
    env = _environment(job.suite, job.task, job.seed)
    env.max_steps = job.max_steps
    clock.start()
    started = time.monotonic()
    client = policy_client(job, settings)
    broker = make_broker(client, job.inference, episode_id=f"episode-{job.episode_id}-{job.attempts}")
    # Other protocols' policies are language-conditioned: they get the task's instruction, not its name.
    task_text = None if job.protocol == PolicyProtocol.EVALFORGE else env.suite.instruction(job.task)
    act = policy = observing_policy(env, broker, job.cameras, task_text=task_text)
    recorder = None
    if recorders is not None:
        recorder = ReplayRecorder(env, settings.replay_every,
                                  replay_camera(env.suite, job.cameras, settings.replay_camera))
        recorders.append(recorder)

        def act(obs: dict) -> np.ndarray:
            recorder.capture(env.steps)
            return policy(obs)

    if rollouts is not None:
        rollouts.append(recording.RolloutRecorder(env, job.cameras))
        act = rollouts[-1].wrap(act)
    try:
        outcome = run_policy_episode(env, act, seed=job.seed, on_step=on_step)
        if recorder is not None:
            recorder.capture(env.steps, last=True)
    except _OutOfTime as exc:
        exc.policy_s, exc.try_s = float(sum(broker.latencies_s)), time.monotonic() - started
        raise
    except (PolicyUnavailable, PolicyTimeout, OSError, EOFError, WebSocketException) as exc:
        client.close()
        # The last try's reason is the episode's: only an episode none of whose tries got an answer
        # ends policy_unreachable (a harness failure, out of success rates).
        unreached = isinstance(exc, PolicyUnavailable) and not broker.latencies_s
        reason = FailureReason.POLICY_UNREACHABLE if unreached else FailureReason.POLICY_TIMEOUT
        raise _PolicyRetryable(reason, f"policy server {job.endpoint}: {exc}") from exc
    except PolicyError as exc:
        if exc.code not in _TRANSIENT_CODES:
            raise
        client.close()
        raise _PolicyRetryable(FailureReason.POLICY_ERROR, f"policy server {job.endpoint}: {exc}") from exc
    latency_mean_ms, latency_p95_ms = latency_summary_ms(broker.latencies_s)
    return EpisodeResult(success=outcome.success, total_return=outcome.total_reward, steps=outcome.steps,
                         duration_s=outcome.duration_s, latency_mean_ms=latency_mean_ms, latency_p95_ms=latency_p95_ms)


# ---------------------------------------------------------------------------- batches (PostgreSQL)
#
# A message of K episode ids (services.queue: EVALFORGE_EPISODES_PER_MESSAGE) is played by one task:
# the K claims and the reads of their jobs are one statement (services.store.batches.claim_episodes);
# the episodes are played one after the other in the task's thread, every lease the batch still holds
# is extended by one statement per heartbeat; each result goes to this process's ResultWriter, which
# writes what every thread has finished in one statement every RESULT_FLUSH_S (or when a task ends
# its batch) and then checks finalisation once per evaluation written.

RESULT_FLUSH_S = 0.1
"""Longest a finished episode's result waits in a worker before it is written with the others."""


def batches_supported(session_factory: sessionmaker[Session]) -> bool:
    """Whether the store takes the batched statements (PostgreSQL); SQLite keeps the per-episode path."""
    bind = session_factory.kw.get("bind")
    return isinstance(bind, Engine) and bind.dialect.name == "postgresql"


@dataclass
class _PendingResult:
    """A result handed to the ``ResultWriter``; ``done`` is set once it was written or refused (``written``)."""

    outcome: batches.EpisodeOutcome
    evaluation_id: int
    done: threading.Event
    written: bool = False
    finalised: bool = False
    error: BaseException | None = None


class ResultWriter:
    """One worker process's buffer of finished episodes' results, written together.

    ``add`` hands a result over (it returns at once); a daemon thread writes whatever is pending
    ``flush_s`` after the first of it arrived; ``wait(items)`` writes at once what is still pending
    and returns when ``items`` are written (a task acknowledges its message only then, so a worker
    killed meanwhile loses leases, never a result it acknowledged). Each write is one
    ``batches.finish_episodes`` (each row written only while still this worker's, at its attempt)
    and then one ``queries.finalize_evaluation_if_done`` per evaluation written, on one connection;
    a store that is restarting is waited for as for a single result (``retry_while_store_down``)."""

    def __init__(self, session_factory: sessionmaker[Session], worker_id: str, *, flush_s: float = RESULT_FLUSH_S,
                 store_retry_s: float = 300.0) -> None:
        self.session_factory = session_factory
        self.worker_id = worker_id
        self.flush_s = flush_s
        self.store_retry_s = store_retry_s
        self._pending: list[_PendingResult] = []
        self._cond = threading.Condition()
        self._flushing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, outcome: batches.EpisodeOutcome, evaluation_id: int) -> _PendingResult:
        item = _PendingResult(outcome, evaluation_id, threading.Event())
        with self._cond:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="evalforge-result-writer", daemon=True)
                self._thread.start()
            self._cond.notify()
        return item

    def wait(self, items: list[_PendingResult]) -> None:
        """Return once every one of ``items`` is written or refused; raise the store's error if writing failed."""
        if any(not item.done.is_set() for item in items):
            self.flush()
        for item in items:
            item.done.wait()
            if item.error is not None:
                raise item.error

    def flush(self) -> None:
        """Write everything pending now (after a write already under way, which may hold some of it)."""
        with self._flushing:
            with self._cond:
                take, self._pending = self._pending, []
            if take:
                self._write(take)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
            time.sleep(self.flush_s)
            try:
                self.flush()
            except Exception:  # recorded on the items; their tasks raise it
                log.exception("writing episode results failed")

    def _write(self, take: list[_PendingResult]) -> None:
        written: dict[tuple[int, int], int] | None = None

        def write() -> set[int]:
            nonlocal written
            with _one_connection(self.session_factory) as session:
                if written is None:
                    written = batches.finish_episodes(session, [item.outcome for item in take], self.worker_id)
                evaluations = sorted(set(written.values()))
                return {e for e in evaluations if queries.finalize_evaluation_if_done(session, e)}

        try:
            finalised = retry_while_store_down(write, what=f"{len(take)} episode results",
                                               budget_s=self.store_retry_s)
        except BaseException as exc:
            for item in take:
                item.error = exc
                item.done.set()
            raise
        assert written is not None
        for item in take:
            item.written = (item.outcome.episode_id, item.outcome.attempts) in written
            if item.written and item.evaluation_id in finalised:
                item.finalised = True
                finalised.discard(item.evaluation_id)  # said once, by one of its results
            item.done.set()


_writers: dict[tuple[int, int, str], ResultWriter] = {}
_writers_lock = threading.Lock()


def result_writer(session_factory: sessionmaker[Session], worker_id: str, settings: WorkerSettings) -> ResultWriter:
    """This process's ``ResultWriter`` for ``session_factory`` and ``worker_id`` (a forked child makes its own)."""
    key = (os.getpid(), id(session_factory), worker_id)
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = ResultWriter(session_factory, worker_id, store_retry_s=settings.store_retry_s)
        return writer


class _BatchLeases:
    """The leases one batch holds: all extended by one statement per ``heartbeat_s``; the beat says which
    were lost (taken over, closed) and which belong to an evaluation cancelled meanwhile."""

    def __init__(self, session_factory: sessionmaker[Session], worker_id: str, settings: WorkerSettings,
                 held: dict[int, int]) -> None:
        self.session_factory, self.worker_id, self.settings = session_factory, worker_id, settings
        self.held = dict(held)  # episode id → the attempt this worker claimed
        self.lost: set[int] = set()
        self.cancelled: set[int] = set()
        self.last = time.monotonic()

    def beat_if_due(self) -> None:
        if time.monotonic() - self.last < self.settings.heartbeat_s or not self.held:
            return
        try:
            with self.session_factory() as session:
                found = batches.extend_leases(session, list(self.held.items()), self.worker_id, self.settings.lease_s)
        except Exception as exc:
            if not is_store_outage(exc):
                raise
            log.warning("episodes %s: heartbeat skipped, the store is unreachable (%s)", sorted(self.held),
                        str(exc).splitlines()[0][:200])
            found = None
        if found is not None:
            for episode_id in set(self.held) - found.held:
                self.lost.add(episode_id)
                del self.held[episode_id]
            self.cancelled |= found.cancelled
        self.last = time.monotonic()

    def heartbeat_of(self, episode_id: int) -> Callable[[], None]:
        def heartbeat() -> None:
            self.beat_if_due()
            if episode_id in self.lost:
                raise LeaseLost(f"episode {episode_id} is no longer held by {self.worker_id}")
        return heartbeat

    def release(self, episode_id: int) -> None:
        self.held.pop(episode_id, None)


def _claim_batch(session_factory: sessionmaker[Session], episode_ids: list[int], worker_id: str,
                 settings: WorkerSettings, *, sleep: Callable[[float], None]) -> dict[int, _Job]:
    claimed: dict[int, Any] = {}

    def claim() -> None:
        with _one_connection(session_factory) as session:
            missing = [i for i in episode_ids if i not in claimed]
            for row in batches.claim_episodes(session, missing, worker_id, settings.lease_s,
                                              max_attempts=settings.max_attempts):
                claimed[row[0]] = row
            # An evaluation's first claims: it is marked running with them (rare: one batch per evaluation).
            missing = [i for i in episode_ids if i not in claimed]
            for row in batches.claim_episodes(session, missing, worker_id, settings.lease_s,
                                              max_attempts=settings.max_attempts, start_pending=True):
                claimed[row[0]] = row

    retry_while_store_down(claim, what=f"claiming episodes {episode_ids[0]}…{episode_ids[-1]}",
                           budget_s=settings.store_retry_s, sleep=sleep)
    return {episode_id: _job_from_row(episode_id, row[1:]) for episode_id, row in claimed.items()}


def _outcome(job: _Job, played: _Played) -> batches.EpisodeOutcome:
    family = get_suite(job.suite).simulator
    result = played.result
    return batches.EpisodeOutcome(
        job.episode_id, job.attempts, (EpisodeStatus.SUCCEEDED if played.succeeded else EpisodeStatus.FAILED).value,
        played.succeeded, total_return=result.total_return, steps=result.steps, duration_s=result.duration_s,
        latency_mean_ms=result.latency_mean_ms, latency_p95_ms=result.latency_p95_ms,
        failure_reason=played.reason.value if played.reason else None,
        error_message=played.message[:2000] if played.message else None, artifact_path=played.artifact_path,
        recording_path=played.recording_path, simulator_versions=simulator_versions(family) or None,
        initial_state_index=_initial_state_index(job), worker_host=_HOST, renderer=renderer(family),
        finished_at=utcnow())


_HOST = socket.gethostname()


def _checked_once() -> Callable[[str], None]:
    """``check_endpoint``, asked once per endpoint for one batch: reading ``EVALFORGE_POLICY_HOSTS`` (a
    settings object) cost a short episode more than its claim does after batching."""
    answers: dict[str, EndpointRefused | None] = {}

    def check(endpoint: str) -> None:
        if endpoint not in answers:
            try:
                check_endpoint(endpoint)
                answers[endpoint] = None
            except EndpointRefused as exc:
                answers[endpoint] = exc
        refused = answers[endpoint]
        if refused is not None:
            raise EndpointRefused(str(refused))
    return check


def run_episode_batch(session_factory: sessionmaker[Session], episode_ids: list[int], worker_id: str,
                      settings: WorkerSettings, *, sleep: Callable[[float], None] = time.sleep,
                      on_start: Callable[[int], None] | None = None) -> list[RunResult]:
    """Claim, play and record the stored episodes ``episode_ids`` (one message's batch), one after the
    other; one ``RunResult`` per distinct id, in their order. Safe to call again with the same ids.

    Every per-episode rule of ``run_episode_by_id`` holds per row: an id that is not claimable is
    skipped (or closed ``worker_lost`` when out of attempts); an episode whose lease was lost is
    dropped (``superseded``); one of an evaluation cancelled before the batch reached it is closed
    ``cancelled`` unplayed (the one playing finishes, as running episodes do); each result is written
    once, only while the episode is still this worker's. ``on_start(episode_id)`` is called as each
    episode starts (the in-flight watchdog's clock). On SQLite: ``run_episode_by_id`` per id."""
    ids = list(dict.fromkeys(int(i) for i in episode_ids))
    if not batches_supported(session_factory):
        results = []
        for episode_id in ids:
            if on_start is not None:
                on_start(episode_id)
            results.append(run_episode_by_id(session_factory, episode_id, worker_id, settings, sleep=sleep))
        return results
    writer = result_writer(session_factory, worker_id, settings)
    jobs = _claim_batch(session_factory, ids, worker_id, settings, sleep=sleep)
    results: dict[int, RunResult] = {i: _why_not_claimed(session_factory, i, settings) for i in ids if i not in jobs}
    leases = _BatchLeases(session_factory, worker_id, settings, {i: job.attempts for i, job in jobs.items()})
    check = _checked_once()
    pending: list[tuple[_Job, _Played | None, _PendingResult]] = []
    try:
        for episode_id in (i for i in ids if i in jobs):
            job = jobs[episode_id]
            leases.beat_if_due()
            if episode_id in leases.lost:
                results[episode_id] = RunResult(episode_id, "superseded", attempts=job.attempts,
                                                detail=f"episode {episode_id} is no longer held by {worker_id}")
                continue
            if episode_id in leases.cancelled:  # cancelled before it started: closed, never played
                leases.release(episode_id)
                outcome = batches.EpisodeOutcome(episode_id, job.attempts, EpisodeStatus.CANCELLED.value, False,
                                                 failure_reason=FailureReason.CANCELLED.value, worker_host=_HOST,
                                                 finished_at=utcnow())
                pending.append((job, None, writer.add(outcome, job.evaluation_id)))
                continue
            if on_start is not None:
                on_start(episode_id)
            try:
                played = _play_claimed(session_factory, job, settings, leases.heartbeat_of(episode_id), sleep, check)
            except SoftTimeLimitExceeded as exc:
                exc.episode_id = episode_id  # the task records it worker_lost; the rest keep their leases
                raise
            leases.release(episode_id)  # from here its lease lasts until the writer's next write
            if isinstance(played, RunResult):
                results[episode_id] = played
                continue
            pending.append((job, played, writer.add(_outcome(job, played), job.evaluation_id)))
    finally:
        writer.wait([item for _, _, item in pending])
    for job, played, item in pending:
        if not item.written:
            results[job.episode_id] = RunResult(job.episode_id, "superseded", attempts=job.attempts,
                                                finalised=item.finalised,
                                                detail="the episode was closed by someone else meanwhile")
        elif played is None:
            results[job.episode_id] = RunResult(job.episode_id, "cancelled", FailureReason.CANCELLED.value,
                                                job.attempts, item.finalised, "its evaluation was cancelled")
        else:
            results[job.episode_id] = played.run_result(job, finalised=item.finalised)
    return [results[i] for i in ids]
