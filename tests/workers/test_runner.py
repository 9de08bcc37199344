"""The runner function directly: a real MetaWorld env and policy server, a failing simulator, a
dead policy server, and exactly-once finalisation under racing workers (store level, threads)."""

from __future__ import annotations

import threading
import time

import pytest

from services.store import queries
from services.store.models import EvaluationStatus
from services.supervisor import free_port
from services.workers import runner
from tests.workers.conftest import (
    MAX_STEPS,
    SUITE,
    TASK,
    episodes_of,
    evaluation,
    fast_settings,
    make_evaluation,
)

pytestmark = pytest.mark.postgres


@pytest.fixture(autouse=True)
def _fresh_caches():
    yield
    runner.close_caches()


def test_success_path_records_one_result_and_finalises(sessions, policy_server):
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)
    settings = fast_settings()
    results = [runner.run_episode_by_id(sessions, i, "test-worker", settings) for i in ids]
    assert [r.status in ("succeeded", "failed") for r in results] == [True, True]
    assert [r.finalised for r in results] == [False, True]
    for row in episodes_of(sessions, evaluation_id):
        assert row.status in ("succeeded", "failed") and row.failure_reason is None
        assert row.steps == MAX_STEPS and row.attempts == 1 and row.duration_s > 0
        assert row.latency_mean_ms > 0 and row.latency_p95_ms >= row.latency_mean_ms * 0.5
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    # A duplicate delivery of a finished episode is a no-op.
    again = runner.run_episode_by_id(sessions, ids[0], "other-worker", settings)
    assert again.status == "skipped"
    assert episodes_of(sessions, evaluation_id)[0].attempts == 1


def test_env_error_fails_the_episode_and_the_worker_goes_on(sessions, policy_server, monkeypatch):
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)
    env = runner._environment(SUITE, TASK, 1_000_000)

    def broken_step(action):
        raise RuntimeError("mujoco: simulation unstable (test)")

    monkeypatch.setattr(env, "_step", broken_step)
    first = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
    assert (first.status, first.failure_reason) == ("failed", "env_error")
    second = runner.run_episode_by_id(sessions, ids[1], "w", fast_settings())  # a fresh simulator
    assert second.status in ("succeeded", "failed") and second.failure_reason is None
    rows = episodes_of(sessions, evaluation_id)
    assert "simulation unstable" in rows[0].error_message
    assert evaluation(sessions, evaluation_id).finalised


def test_policy_server_down_retries_then_policy_timeout(sessions):
    evaluation_id, ids = make_evaluation(sessions, f"ws://127.0.0.1:{free_port()}/ws", 1)
    settings = fast_settings(policy_retries=2, policy_connect_deadline_s=0.5, policy_backoff_s=0.1,
                             policy_backoff_max_s=0.2)
    started = time.monotonic()
    result = runner.run_episode_by_id(sessions, ids[0], "w", settings)
    assert (result.status, result.failure_reason) == ("failed", "policy_timeout")
    assert time.monotonic() - started < 10
    row = episodes_of(sessions, evaluation_id)[0]
    assert "after 3 tries" in row.error_message and "no policy server answered" in row.error_message
    assert evaluation(sessions, evaluation_id).finalised


def test_cancelled_evaluation_is_not_run(sessions, policy_server):
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 1)
    with sessions() as session:
        queries.cancel_evaluation(session, evaluation_id)
    assert runner.run_episode_by_id(sessions, ids[0], "w", fast_settings()).status == "skipped"
    row = episodes_of(sessions, evaluation_id)[0]
    assert (row.status, row.failure_reason, row.attempts) == ("cancelled", "cancelled", 0)


def test_two_workers_finishing_the_last_two_episodes_finalise_once(sessions):
    for _ in range(5):
        evaluation_id, ids = make_evaluation(sessions, "ws://127.0.0.1:1/ws", 2)
        with sessions() as session:
            for i in ids:
                assert queries.claim_episode(session, i, f"w{i}", 60)
        barrier, outcomes = threading.Barrier(2), []

        def finish(episode_id: int, evaluation_id: int, barrier: threading.Barrier, outcomes: list) -> None:
            with sessions() as session:
                barrier.wait()
                queries.finish_episode(session, episode_id, success=True, total_return=1.0, steps=5)
                outcomes.append(queries.finalize_evaluation_if_done(session, evaluation_id))

        threads = [threading.Thread(target=finish, args=(i, evaluation_id, barrier, outcomes)) for i in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == [False, True]
        assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
