"""The runner function directly: a real MetaWorld env and policy server, a failing simulator, a
dead policy server, and exactly-once finalisation under racing workers (store level, threads)."""

from __future__ import annotations

import threading
import time

import pytest

from services.store import aggregates, queries
from services.store.models import Evaluation, EvaluationStatus
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


def test_policy_server_down_retries_then_policy_unreachable_a_harness_failure(sessions):
    """An endpoint nothing answers on says nothing about the policy: its episodes are harness
    failures (out of the success rate), and an evaluation made of them fails, unranked, not 0%."""
    evaluation_id, ids = make_evaluation(sessions, f"ws://127.0.0.1:{free_port()}/ws", 1)
    settings = fast_settings(policy_retries=2, policy_connect_deadline_s=0.5, policy_backoff_s=0.1,
                             policy_backoff_max_s=0.2)
    started = time.monotonic()
    result = runner.run_episode_by_id(sessions, ids[0], "w", settings)
    assert (result.status, result.failure_reason) == ("failed", "policy_unreachable")
    assert time.monotonic() - started < 10
    row = episodes_of(sessions, evaluation_id)[0]
    assert "after 3 tries" in row.error_message and "no policy server answered" in row.error_message
    done = evaluation(sessions, evaluation_id)
    assert done.finalised and done.status == "failed"
    with sessions() as session:
        overall = queries.evaluation_results(session, session.get(Evaluation, evaluation_id))["overall"]
    assert overall["scored"] == 0 and overall["success_rate"] is None
    assert overall["failure_reasons"] == {"policy_unreachable": 1}
    assert "harness failures (policy_unreachable: 1)" in aggregates.unranked_reason(overall)


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


def test_a_server_serving_another_checkpoint_fails_the_episode_and_is_never_scored(sessions, policy_server):
    from policy_format import checkpoint_digest

    served = checkpoint_digest(policy_server.checkpoint)
    registered = "cd" * 32  # what the policy was registered with; the server at its endpoint serves another
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2, name="swapped",
                                         checkpoint_sha256=registered)
    results = [runner.run_episode_by_id(sessions, i, "w", fast_settings()) for i in ids]
    assert [(r.status, r.failure_reason) for r in results] == [("failed", "checkpoint_mismatch")] * 2
    for row in episodes_of(sessions, evaluation_id):
        assert row.attempts == 1 and row.steps is None and row.success is False  # not retried, never played
        assert registered in row.error_message and served in row.error_message
    # Harness failures only: nothing scored, so the evaluation fails instead of reading 0 %.
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FAILED


def test_a_checkpoint_swapped_behind_the_endpoint_is_caught_at_the_next_connection(
        sessions, reach_checkpoint, tmp_path):
    import shutil

    from policy_format import checkpoint_digest
    from tests.workers.conftest import start_policy_server

    original = start_policy_server(reach_checkpoint, tmp_path)
    endpoint, port = original.ws_url, original.port
    try:
        evaluation_id, ids = make_evaluation(sessions, endpoint, 2, name="swap-later")
        first = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
        assert first.failure_reason is None  # the registered checkpoint: played
    finally:
        original.stop()
    other = tmp_path / "other"
    shutil.copytree(reach_checkpoint, other)
    (other / "config.json").write_text((other / "config.json").read_text() + "\n")  # another checkpoint sha256
    swapped = start_policy_server(other, tmp_path, port=port)
    try:
        second = runner.run_episode_by_id(sessions, ids[1], "w", fast_settings())  # the cached client reconnects
    finally:
        swapped.stop()
    assert (second.status, second.failure_reason) == ("failed", "checkpoint_mismatch")
    message = episodes_of(sessions, evaluation_id)[1].error_message
    assert checkpoint_digest(other) in message and checkpoint_digest(reach_checkpoint) in message


def test_a_worker_does_not_connect_outside_policy_hosts(sessions, monkeypatch):
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        evaluation_id, ids = make_evaluation(sessions, f"ws://127.0.0.1:{listener.getsockname()[1]}/ws", 1,
                                             name="outside")
        monkeypatch.setenv("EVALFORGE_POLICY_HOSTS", "10.0.0.0/8")
        result = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert (result.status, result.failure_reason) == ("failed", "endpoint_refused")
    row = episodes_of(sessions, evaluation_id)[0]
    assert "EVALFORGE_POLICY_HOSTS" in row.error_message and row.attempts == 1
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FAILED
