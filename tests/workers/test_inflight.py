"""Episodes in flight (issue #23): one worker process playing up to N episodes at once.

Real processes throughout: ``evalforge worker --episodes-in-flight N`` subprocesses on a scratch
PostgreSQL database and a throwaway Redis, the MetaWorld reach simulator, and the deterministic
``policy-server --engine hf`` on an untrained reach policy. The same seeds played with N = 1 and
N = 8 end with the same (success, steps, return) per episode; cancelling and a SIGKILLed worker
behave as with one episode per process; the watchdog that stands in for Celery's time limits
records and exits as it says."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from services.queue import CeleryEpisodeQueue
from services.store import queries
from services.store.models import EpisodeStatus, EvaluationStatus
from services.workers import inflight, runner
from tests.workers.conftest import (
    REPO,
    SUITE,
    TASK,
    WorkerProcess,
    episodes_of,
    evaluation,
    make_evaluation,
    wait_for,
    worker_env,
)
from tests.workers.test_faults import _running_sweeper

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

STEPS = 40  # ten inferences of a 4-action chunk per episode


@pytest.fixture
def start_inflight_worker(pg_database, tmp_path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(redis_url: str, name: str, in_flight: int, simulators: str = "metaworld",
              **overrides: object) -> WorkerProcess:
        log_path = tmp_path / f"worker-{name}.log"
        worker = WorkerProcess(
            [sys.executable, "-m", "services.cli", "worker", "--episodes-in-flight", str(in_flight),
             "--hostname", f"{name}@%h", "--log-level", "info", "--simulators", simulators],
            log_path, health=lambda: "ready." in log_path.read_text(errors="replace"), cwd=REPO,
            env=worker_env(pg_database, redis_url, **overrides), grace_s=15, startup_timeout_s=60)
        started.append(worker)
        worker.start().wait_healthy()
        return worker

    yield start
    for worker in started:
        worker.stop()


def _outcomes(sessions, evaluation_id: int) -> dict[int, tuple]:
    """seed → (success, steps, return) of a finished evaluation."""
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    rows = episodes_of(sessions, evaluation_id)
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None for r in rows), \
        [(r.status, r.failure_reason, r.error_message) for r in rows]
    return {r.seed: (r.success, r.steps, round(r.total_return, 6)) for r in rows}


def _most_at_once(rows) -> int:
    """The most episodes whose claim → result intervals overlapped."""
    events = sorted([(r.started_at, 1) for r in rows] + [(r.finished_at, -1) for r in rows])
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


def test_outcomes_do_not_change_with_episodes_in_flight(sessions, policy_server, redis_server,
                                                        start_inflight_worker):
    queue = CeleryEpisodeQueue(redis_server.url)
    results, overlap = {}, {}
    for n in (1, 8):
        evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 8, max_steps=STEPS)
        worker = start_inflight_worker(redis_server.url, f"inflight{n}", n)
        queue.enqueue(ids if n == 1 else list(reversed(ids)))
        wait_for(lambda eid=evaluation_id: evaluation(sessions, eid).finalised, 120,
                 f"the evaluation with {n} in flight to finish")
        worker.stop()
        results[n] = _outcomes(sessions, evaluation_id)
        rows = episodes_of(sessions, evaluation_id)
        assert len({r.worker_id for r in rows}) == 1  # one process played them all
        overlap[n] = _most_at_once(rows)
    assert len(results[1]) == 8
    assert results[8] == results[1]
    assert overlap[1] == 1
    assert overlap[8] >= 4  # the episodes really were in flight together


def test_cancel_and_a_killed_worker_with_episodes_in_flight(sessions, policy_server, redis_server,
                                                            start_inflight_worker):
    queue = CeleryEpisodeQueue(redis_server.url)

    # Cancel mid-run: the running episodes finish, the pending ones are never claimed.
    cancelled_id, ids = make_evaluation(sessions, policy_server.ws_url, 24, max_steps=150)
    worker = start_inflight_worker(redis_server.url, "cancel", 4)
    queue.enqueue(ids)
    wait_for(lambda: sum(r.status == "running" for r in episodes_of(sessions, cancelled_id)) >= 2, 60,
             "episodes to be in flight")
    with sessions() as session:
        queries.cancel_evaluation(session, cancelled_id)
    wait_for(lambda: evaluation(sessions, cancelled_id).finalised, 90, "the cancelled evaluation to close")
    rows = episodes_of(sessions, cancelled_id)
    assert evaluation(sessions, cancelled_id).status == EvaluationStatus.CANCELLED
    never = [r for r in rows if r.status == EpisodeStatus.CANCELLED]
    played = [r for r in rows if r.status in (EpisodeStatus.SUCCEEDED, EpisodeStatus.FAILED)]
    assert len(never) + len(played) == 24 and never and played
    assert all(r.attempts == 0 for r in never)
    assert all(r.failure_reason is None and r.steps for r in played)  # finished, not cut off
    worker.stop()

    # SIGKILL with episodes in flight: only their leases are lost, and the sweeper returns them.
    killed_id, ids = make_evaluation(sessions, policy_server.ws_url, 6, max_steps=150)
    victim = start_inflight_worker(redis_server.url, "victim", 6)
    queue.enqueue(ids)
    wait_for(lambda: sum(r.status == "running" for r in episodes_of(sessions, killed_id)) >= 3, 60,
             "episodes to be in flight")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    held = {r.id for r in episodes_of(sessions, killed_id) if r.status == "running"}
    assert len(held) >= 3
    start_inflight_worker(redis_server.url, "rescuer", 6)
    with _running_sweeper(sessions, redis_server.url) as sweeper:
        wait_for(lambda: evaluation(sessions, killed_id).finalised, 120, "the evaluation to finish")
    assert held <= set(sweeper.reenqueued)
    rows = episodes_of(sessions, killed_id)
    assert evaluation(sessions, killed_id).status == EvaluationStatus.FINISHED
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None for r in rows)
    assert all(r.attempts == (2 if r.id in held else 1) for r in rows), [(r.id, r.attempts) for r in rows]


def test_watchdog_records_a_stuck_episode_then_stops_the_process(sessions):
    evaluation_id, ids = make_evaluation(sessions, "ws://127.0.0.1:1/ws", 2)
    with sessions() as session:
        assert queries.claim_episode(session, ids[0], "w", 60.0, max_attempts=3)
    now = [0.0]
    exits: list[int] = []
    watchdog = inflight.EpisodeWatchdog(lambda: sessions, soft_s=10, hard_s=20, clock=lambda: now[0],
                                        exit_process=exits.append)
    watchdog.track("task-1", ids[0])
    now[0] = 9.0
    watchdog.check_once()
    assert episodes_of(sessions, evaluation_id)[0].status == "running"
    now[0] = 10.5
    watchdog.check_once()
    first = episodes_of(sessions, evaluation_id)[0]
    assert (first.status, first.failure_reason) == ("failed", "worker_lost")
    assert "soft time limit of 10 s" in first.error_message
    assert exits == []
    now[0] = 21.0
    watchdog.check_once()
    assert exits == [inflight.EXIT_STUCK]
    watchdog.done("task-1")
    assert watchdog.in_flight == 0


def test_each_thread_has_its_own_simulator():
    envs: dict[str, object] = {}

    def build(name: str) -> None:
        envs[name] = runner._environment(SUITE, TASK, 1_000_000)
        envs[name + "-again"] = runner._environment(SUITE, TASK, 1_000_000)

    threads = [threading.Thread(target=build, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert envs["a"] is envs["a-again"] and envs["b"] is envs["b-again"]  # cached within a thread
        assert envs["a"] is not envs["b"]  # never shared between threads
    finally:
        runner.close_caches()
    assert not any(cache for cache in runner._envs.every_thread())


def test_worker_options_are_checked():
    assert inflight.celery_pool_arguments(8) == ["--pool", "threads", "--concurrency", "8"]
    with pytest.raises(ValueError, match="at least 1"):
        inflight.celery_pool_arguments(0)
    with pytest.raises(ValueError, match="EVALFORGE_DB_MAX_OVERFLOW"):
        inflight.check_database_pool(40, 10, 20)
    inflight.check_database_pool(16, 10, 20)
