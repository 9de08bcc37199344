"""Fault tests with real processes: Celery workers (`evalforge worker`), PostgreSQL, a dedicated
Redis, and `policy-server --engine hf`. Each checks that every episode ends with exactly one
result and that the evaluation is finalised."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.queue import CeleryEpisodeQueue
from services.store.models import EvaluationStatus
from services.workers.sweeper import Sweeper
from tests.workers.conftest import (
    MAX_STEPS,
    episodes_of,
    evaluation,
    fast_settings,
    live_count,
    make_evaluation,
    start_policy_server,
    wait_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@contextmanager
def _running_sweeper(sessions, redis_url: str) -> Iterator[Sweeper]:
    settings = fast_settings()
    sweeper = Sweeper(sessions, CeleryEpisodeQueue(redis_url), settings)
    sweeper.reenqueued = []  # every episode id it sent, for the tests to check
    sweep_once = sweeper.sweep_once

    def recording_sweep():
        report = sweep_once()
        sweeper.reenqueued.extend(report.reenqueued)
        return report

    sweeper.sweep_once = recording_sweep
    stop = threading.Event()
    thread = threading.Thread(target=sweeper.run_forever, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    yield sweeper
    stop.set()
    thread.join(5)


def _assert_all_done_once(sessions, evaluation_id: int, count: int) -> list:
    rows = episodes_of(sessions, evaluation_id)
    assert sorted(r.episode_index for r in rows) == list(range(count))
    assert all(r.status in ("succeeded", "failed", "cancelled") for r in rows), [r.status for r in rows]
    assert evaluation(sessions, evaluation_id).finalised
    return rows


def test_duplicate_delivery_is_one_result(sessions, policy_server, redis_server, start_worker):
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)
    worker = start_worker(redis_server.url)
    queue = CeleryEpisodeQueue(redis_server.url)
    assert queue.enqueue([ids[0], ids[0], ids[1], ids[0]]) == 4
    wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 45, "the evaluation to finish")
    time.sleep(1.0)  # let the duplicates be consumed too
    rows = _assert_all_done_once(sessions, evaluation_id, 2)
    assert [r.attempts for r in rows] == [1, 1]
    assert all(r.steps == MAX_STEPS and r.failure_reason is None for r in rows)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    assert worker.log().count("skipped") >= 1, worker.log()


def test_sigkill_worker_mid_episode_runs_it_again(sessions, policy_server, redis_server, start_worker):
    count = 3
    steps = 200  # long enough that the kill lands mid-episode on a fast machine too
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, count, max_steps=steps)
    victim = start_worker(redis_server.url, "victim")
    CeleryEpisodeQueue(redis_server.url).enqueue(ids)
    wait_for(lambda: any(r.status == "running" for r in episodes_of(sessions, evaluation_id)), 30,
             "an episode to start")
    time.sleep(0.3)  # mid-episode
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the worker and its pool process, no goodbye
    victim.proc.wait()
    # With the worker dead the rows are frozen: the one still "running" is the episode it was on.
    killed = [r for r in episodes_of(sessions, evaluation_id) if r.status == "running"]
    assert len(killed) == 1, [(r.episode_index, r.status) for r in episodes_of(sessions, evaluation_id)]
    start_worker(redis_server.url, "rescuer")
    with _running_sweeper(sessions, redis_server.url) as sweeper:
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 60, "the evaluation to finish")
    assert killed[0].id in sweeper.reenqueued
    rows = _assert_all_done_once(sessions, evaluation_id, count)
    again = next(r for r in rows if r.id == killed[0].id)
    assert again.attempts == 2 and again.failure_reason is None and again.steps == steps
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED


def test_policy_server_killed_and_restarted(sessions, reach_checkpoint, redis_server, start_worker, tmp_path):
    count = 8
    server = start_policy_server(reach_checkpoint, tmp_path)
    try:
        evaluation_id, ids = make_evaluation(sessions, server.ws_url, count)
        start_worker(redis_server.url, policy_retries=3, policy_connect_deadline_s=1.0, policy_backoff_s=0.2,
                     policy_backoff_max_s=0.5)
        CeleryEpisodeQueue(redis_server.url).enqueue(ids)
        wait_for(lambda: live_count(sessions, evaluation_id) <= count - 1, 30, "the first episode to end")
        server.stop(signal.SIGKILL)
        time.sleep(4.0)
        server = start_policy_server(reach_checkpoint, tmp_path, port=server.port)
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 60, "the evaluation to finish")
    finally:
        server.stop()
    rows = _assert_all_done_once(sessions, evaluation_id, count)
    gave_up = [r for r in rows if r.failure_reason is not None]
    assert gave_up, "the server was down long enough for an episode to run out of retries"
    for row in gave_up:
        # mid-episode when the server died (timeout), or no try of it reached the server (unreachable)
        assert row.failure_reason in ("policy_timeout", "policy_unreachable") and "tries" in row.error_message, \
            row.error_message
    assert any(r.failure_reason is None and r.steps == MAX_STEPS for r in rows[-2:]), "ran after the restart"
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED


def test_redis_restart_loses_the_queue_and_the_sweeper_recovers(sessions, policy_server, redis_server,
                                                                start_worker):
    count = 6
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, count)
    start_worker(redis_server.url)
    CeleryEpisodeQueue(redis_server.url).enqueue(ids)
    wait_for(lambda: live_count(sessions, evaluation_id) <= count - 1, 30, "the first episode to end")
    redis_server.stop()  # no persistence: every queued message is gone
    redis_server.start()
    with _running_sweeper(sessions, redis_server.url) as sweeper:
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 60, "the evaluation to finish")
    assert sweeper.reenqueued, "the lost messages came back through the sweeper"
    rows = _assert_all_done_once(sessions, evaluation_id, count)
    assert all(r.failure_reason is None and r.steps == MAX_STEPS for r in rows)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
