"""Episodes in flight: one worker process that plays up to N episodes at once.

``evalforge worker --episodes-in-flight N`` runs Celery's ``threads`` pool with N threads in
one process and a prefetch of exactly N messages (``worker_prefetch_multiplier=1`` ×
N). Each thread runs the same task as a prefork worker — ``evalforge.run_episode`` →
``runner.run_episode_by_id``, the one function that plays an episode — with its own
simulator and its own policy-server connection (``runner``'s caches are per thread). While
one episode waits for its actions the others step, so the policy server receives requests
from N connections at once and batches them (``VllmEngine``'s continuous batching).

Why threads, not asyncio:

- the episode path is synchronous end to end — ``run_policy_episode``, every simulator
  (MuJoCo, pymunk), the sync ``PolicyClient``, SQLAlchemy sessions. An asyncio scheduler
  would need an async twin of the runner and of the client (two implementations of one
  contract) and would still have to push each simulator step to a thread;
- what an episode does while another waits is either blocking socket I/O or a MuJoCo
  step, and both release the GIL; the Python left (building observations, the codec,
  claiming and recording) is small next to a 40 ms policy round trip, so N threads keep N
  episodes moving until one core is saturated (docs/benchmarks.md, "Episodes in flight");
- Celery's own pool keeps every delivery rule unchanged: late acknowledgement (a killed
  process loses no message — Redis redelivers it after ``visibility_timeout``, and the
  sweeper re-enqueues its expired leases), prefetch bounded to the slots, per-family
  queues, graceful shutdown (the threads finish their episodes).

Every per-episode guarantee is the runner's and holds per thread: the claim (a
conditional update) and the lease with its heartbeat every ``heartbeat_s`` seconds, the
result written once, cancelling (pending episodes are closed by the API and never
claimed; running ones finish), the per-episode time limit checked every step, the
retries against the policy server.

What the threads pool lacks is Celery's process-wide soft and hard time limits (they need
a process per task). ``EpisodeWatchdog`` stands in for them: an episode still running past
the soft limit (``tasks.SOFT_TIME_LIMIT_S``: a simulator or policy call that never
returned) is recorded ``worker_lost`` with a message saying so, as the prefork pool's soft
limit does; past the hard limit the process exits (a stuck C call cannot be interrupted in
a thread), and the leases of the episodes it still held expire and are re-enqueued by the
sweeper, as for a killed worker. A batch message (``evalforge.run_episodes``) is timed per
episode: the runner restarts its task's clock as each episode of the batch starts
(``track_episode``), so the limits stay one episode's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from services.store.models import FailureReason

log = logging.getLogger("evalforge.workers.inflight")

EXIT_STUCK = 70
"""Exit status of a worker the watchdog stopped because an episode call never returned."""


def celery_pool_arguments(episodes_in_flight: int) -> list[str]:
    """The ``celery worker`` arguments of a worker with ``episodes_in_flight`` episodes in flight."""
    if episodes_in_flight < 1:
        raise ValueError(f"--episodes-in-flight must be at least 1, got {episodes_in_flight}")
    return ["--pool", "threads", "--concurrency", str(episodes_in_flight)]


def check_database_pool(episodes_in_flight: int, pool_size: int, max_overflow: int) -> None:
    """``ValueError`` when one process's database pool cannot serve N episodes and the heartbeat
    at once (each episode opens one short session at a time)."""
    available = pool_size + max_overflow
    if episodes_in_flight + 1 > available:
        raise ValueError(f"--episodes-in-flight {episodes_in_flight} needs {episodes_in_flight + 1} database "
                         f"connections, but this process may open {available} (EVALFORGE_DB_POOL_SIZE "
                         f"{pool_size} + EVALFORGE_DB_MAX_OVERFLOW {max_overflow}); raise "
                         "EVALFORGE_DB_MAX_OVERFLOW or lower --episodes-in-flight")


@dataclass
class _Running:
    episode_id: int
    started: float
    soft_recorded: bool = False


class EpisodeWatchdog:
    """The threads pool's stand-in for Celery's per-task soft and hard time limits.

    ``track(task_id, episode_id)`` / ``done(task_id)`` are called around each task (from the
    ``task_prerun`` / ``task_postrun`` signals, in the task's own thread); a daemon thread checks
    every ``every_s`` seconds.
    """

    def __init__(self, session_factory: Callable[[], sessionmaker[Session]], *, soft_s: float, hard_s: float,
                 every_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 exit_process: Callable[[int], None] = os._exit) -> None:
        self.session_factory = session_factory
        self.soft_s, self.hard_s, self.every_s = soft_s, hard_s, every_s
        self.clock = clock
        self.exit_process = exit_process
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, task_id: str, episode_id: int) -> None:
        """Time ``episode_id`` from now as the episode task ``task_id`` plays (again, for each episode of a batch)."""
        with self._lock:
            self._running[task_id] = _Running(episode_id, self.clock())

    def done(self, task_id: str) -> None:
        with self._lock:
            self._running.pop(task_id, None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running)

    def check_once(self) -> None:
        """Record episodes past the soft limit ``worker_lost``; exit the process past the hard limit."""
        from services.workers import runner

        now = self.clock()
        with self._lock:
            overdue = [(task_id, r) for task_id, r in self._running.items() if now - r.started >= self.soft_s]
        for task_id, running in overdue:
            if now - running.started >= self.hard_s:
                log.critical("episode %d (task %s) has run %.0f s, past the hard time limit of %.0f s: a "
                             "simulator or policy call never returned; stopping this worker process (its other "
                             "episodes' leases expire and the sweeper re-enqueues them)", running.episode_id,
                             task_id, now - running.started, self.hard_s)
                self.exit_process(EXIT_STUCK)
                return
            if not running.soft_recorded:
                running.soft_recorded = True
                runner.fail_episode(
                    self.session_factory(), running.episode_id, FailureReason.WORKER_LOST,
                    f"the episode ran past the worker's process-wide soft time limit of {self.soft_s:.0f} s: a "
                    "simulator or policy call never returned (raise EVALFORGE_SECONDS_PER_STEP if the simulator "
                    "or policy is really this slow)")

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                self.check_once()
            except Exception:  # the store restarting: the next check tries again
                log.exception("episode watchdog check failed; trying again in %.0f s", self.every_s)

    def start(self) -> EpisodeWatchdog:
        self._thread = threading.Thread(target=self._run, name="evalforge-episode-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1)


_installed: EpisodeWatchdog | None = None


def track_episode(task_id: str | None, episode_id: int) -> None:
    """Episode ``episode_id`` of batch task ``task_id`` starts: time it (a no-op without a watchdog)."""
    if _installed is not None and task_id:
        _installed.track(task_id, episode_id)


def install_watchdog(*, every_s: float = 5.0) -> EpisodeWatchdog:
    """Start an ``EpisodeWatchdog`` on the episode task's limits and connect it to Celery's task signals."""
    global _installed
    from celery.signals import task_postrun, task_prerun

    from services.queue import RUN_EPISODE_TASK
    from services.workers import tasks

    watchdog = EpisodeWatchdog(tasks.session_factory, soft_s=tasks.SOFT_TIME_LIMIT_S, hard_s=tasks.TIME_LIMIT_S,
                               every_s=every_s)
    _installed = watchdog

    def on_prerun(task_id: str | None = None, task: object = None, args: tuple = (), **_: object) -> None:
        if getattr(task, "name", None) == RUN_EPISODE_TASK and task_id and args:
            watchdog.track(task_id, int(args[0]))

    def on_postrun(task_id: str | None = None, **_: object) -> None:
        if task_id:
            watchdog.done(task_id)

    task_prerun.connect(on_prerun, weak=False)
    task_postrun.connect(on_postrun, weak=False)
    return watchdog.start()
