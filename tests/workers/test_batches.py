"""Batched messages and results (issue #23): K episode ids per message, claimed with one statement and
recorded with one statement (``services/store/batches.py``, ``runner.run_episode_batch``).

Real PostgreSQL throughout (a scratch database), and for the end-to-end cases real ``evalforge worker
--episodes-in-flight`` processes off a throwaway Redis against ``policy-server --engine null``: a batch is
claimed by exactly one of two racing claimers; each result is written once and a late or duplicate one
is refused; a worker SIGKILLed with a batch in flight loses only its leases, which the sweeper returns;
cancelling mid-batch closes what the batch had not started; one-id messages (what an older API sends)
are still played beside batches; and the same seeds end the same with batching on and off."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import redis

from benchmarks.null import seeded_success
from services.queue import RUN_EPISODES_TASK, CeleryEpisodeQueue
from services.store import batches, queries
from services.store.models import EpisodeStatus, EvaluationStatus, utcnow
from services.supervisor import PolicyServerProcess
from services.workers import runner
from tests.workers.conftest import (
    REPO,
    WorkerProcess,
    episodes_of,
    evaluation,
    fast_settings,
    wait_for,
    worker_env,
)
from tests.workers.test_faults import _running_sweeper

pytestmark = [pytest.mark.postgres]


@pytest.fixture(scope="module")
def null_server(tmp_path_factory):
    """``policy-server --engine null`` on an untrained null policy; (server, its checkpoint's sha256)."""
    from policy_format import checkpoint_digest
    from trainer.cli import main as trainer_main

    out = tmp_path_factory.mktemp("null") / "policy"
    trainer_main(["init-policy", "--suite", "null", "--out", str(out), "--force"])
    server = PolicyServerProcess(out, "--engine", "null", log_dir=out.parent).start(180)  # a loaded host
    yield server, checkpoint_digest(out)
    server.stop()


@pytest.fixture
def start_inflight_worker(pg_database, tmp_path) -> Iterator[Callable[..., WorkerProcess]]:
    """``evalforge worker --episodes-in-flight N --simulators null`` subprocesses (FAST settings), stopped
    at the end; a long startup allowance, for a loaded host."""
    started: list[WorkerProcess] = []

    def start(redis_url: str, name: str, in_flight: int, simulators: str = "null") -> WorkerProcess:
        log_path = tmp_path / f"worker-{name}.log"
        worker = WorkerProcess(
            [sys.executable, "-m", "services.cli", "worker", "--episodes-in-flight", str(in_flight),
             "--hostname", f"{name}@%h", "--log-level", "info", "--simulators", simulators],
            log_path, health=lambda: "ready." in log_path.read_text(errors="replace"), cwd=REPO,
            env=worker_env(pg_database, redis_url), grace_s=15, startup_timeout_s=240)
        started.append(worker)
        worker.start().wait_healthy()
        return worker

    yield start
    for worker in started:
        worker.stop()


def _null_evaluation(sessions, endpoint: str, sha: str | None, episodes: int, *, max_steps: int = 10,
                     seed0: int = 1_000_000, name: str = "null") -> tuple[int, list[int]]:
    with sessions() as session:
        policy = queries.find_policy(session, name, "v1") or queries.create_policy(
            session, name=name, version="v1", endpoint=endpoint, checkpoint_sha256=sha, state_dim=4, action_dim=2,
            chunk_size=4, tasks=["null"])
        specs = [queries.EpisodeSpec(task="null", seed=seed0 + i, max_steps=max_steps) for i in range(episodes)]
        created = queries.create_evaluation(session, policy_id=policy.id, suite="null", tasks=["null"],
                                            episodes_per_task=episodes, seed=0, max_steps=max_steps, standard=False,
                                            tags=[], episodes=specs)
        return created.evaluation.id, created.episode_ids


def _outcome(episode_id: int, attempts: int, success: bool = True) -> batches.EpisodeOutcome:
    return batches.EpisodeOutcome(episode_id, attempts, "succeeded" if success else "failed", success,
                                  total_return=1.0 if success else 0.0, steps=10, duration_s=0.01,
                                  simulator_versions={"evalforge": "test"}, worker_host="test")


# ---------------------------------------------------------------------------- the statements


def test_a_batch_claim_goes_to_exactly_one_of_two_racing_claimers(sessions):
    for round_ in range(5):
        evaluation_id, ids = _null_evaluation(sessions, "ws://127.0.0.1:1/ws", None, 40, seed0=round_ * 1000)
        won: dict[str, set[int]] = {}
        start = threading.Barrier(2)

        def claim(worker: str, order: list[int], start=start, won=won) -> None:
            with sessions() as session:
                start.wait()
                # start_pending: the first claims of an evaluation mark it running, racing too
                rows = batches.claim_episodes(session, order, worker, 60.0, max_attempts=3, start_pending=True)
                won[worker] = {row[0] for row in rows}

        threads = [threading.Thread(target=claim, args=("a", ids)),
                   threading.Thread(target=claim, args=("b", list(reversed(ids))))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert won["a"] | won["b"] == set(ids) and not won["a"] & won["b"], (round_, won)
        rows = episodes_of(sessions, evaluation_id)
        assert {r.status for r in rows} == {"running"} and {r.attempts for r in rows} == {1}
        assert {r.id for r in rows if r.worker_id == "a"} == won["a"]
        assert evaluation(sessions, evaluation_id).status == EvaluationStatus.RUNNING


def test_a_batch_claim_returns_the_jobs_and_leaves_what_is_not_claimable(sessions):
    evaluation_id, ids = _null_evaluation(sessions, "ws://127.0.0.1:1/ws", "ab" * 32, 5, max_steps=12)
    with sessions() as session:
        # Not running yet: without start_pending nothing is claimed (an evaluation's first claim marks it).
        assert batches.claim_episodes(session, ids[:2], "w", 60.0, max_attempts=3) == []
        assert queries.claim_episode(session, ids[0], "other", 60.0)  # running elsewhere
        assert queries.finish_episode(session, ids[0], success=True)  # … then finished
        assert queries.claim_episode(session, ids[1], "other", 60.0)  # held by a live lease
        rows = batches.claim_episodes(session, [ids[2], ids[0], ids[1], ids[2], ids[3], 10**12], "w", 60.0,
                                      max_attempts=3)
    assert sorted(r[0] for r in rows) == [ids[2], ids[3]]
    job = runner._job_from_row(rows[0][0], rows[0][1:])
    assert (job.evaluation_id, job.suite, job.task, job.max_steps, job.attempts, job.endpoint,
            job.checkpoint_sha256, job.action_dim) == (evaluation_id, "null", "null", 12, 1, "ws://127.0.0.1:1/ws",
                                                      "ab" * 32, 2)
    by_id = {r.id: r for r in episodes_of(sessions, evaluation_id)}
    assert by_id[ids[1]].worker_id == "other" and by_id[ids[4]].status == "pending"
    with sessions() as session:  # out of attempts: not claimed, even with its lease expired
        assert batches.claim_episodes(session, [ids[4]], "w", 60.0, max_attempts=0) == []
        queries.cancel_evaluation(session, evaluation_id)
        assert batches.claim_episodes(session, [ids[4]], "w", 60.0, max_attempts=3, start_pending=True) == []


def test_batch_results_are_written_once_and_late_or_duplicate_ones_refused(sessions):
    evaluation_id, ids = _null_evaluation(sessions, "ws://127.0.0.1:1/ws", None, 4)
    long_ago = utcnow() - timedelta(minutes=5)
    with sessions() as session:
        # a: ids 0, 1 for a minute; ids 2, 3 with a lease that has already expired
        assert len(batches.claim_episodes(session, ids[:2], "a", 60.0, max_attempts=3, start_pending=True)) == 2
        assert len(batches.claim_episodes(session, ids[2:], "a", 1.0, max_attempts=3, now=long_ago)) == 2
        # b takes over the expired ones (attempt 2); a's heartbeat now says it holds only 0 and 1
        assert len(batches.claim_episodes(session, ids[2:], "b", 60.0, max_attempts=3)) == 2
        beat = batches.extend_leases(session, [(i, 1) for i in ids], "a", 60.0)
        assert beat.held == {ids[0], ids[1]} and beat.cancelled == frozenset()
        written = batches.finish_episodes(session, [_outcome(i, 1) for i in ids], "a")  # 2 and 3 are late
        assert written == {(ids[0], 1): evaluation_id, (ids[1], 1): evaluation_id}
        assert batches.finish_episodes(session, [_outcome(ids[0], 1, success=False)], "a") == {}  # duplicate
        assert batches.finish_episodes(session, [_outcome(ids[2], 1)], "b") == {}  # b's lease, a's attempt
        assert not queries.finalize_evaluation_if_done(session, evaluation_id)
        written = batches.finish_episodes(session, [_outcome(ids[2], 2, success=False), _outcome(ids[3], 2)], "b")
        assert set(written) == {(ids[2], 2), (ids[3], 2)}
        assert queries.finalize_evaluation_if_done(session, evaluation_id)
    rows = episodes_of(sessions, evaluation_id)
    assert [(r.status, r.attempts, r.worker_id) for r in rows] == [
        ("succeeded", 1, "a"), ("succeeded", 1, "a"), ("failed", 2, "b"), ("succeeded", 2, "b")]
    assert all(r.lease_expires_at is None and r.finished_at and r.simulator_versions == {"evalforge": "test"}
               for r in rows)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    with pytest.raises(ValueError, match="disagree"):
        batches.EpisodeOutcome(ids[0], 1, "failed", True)


# ---------------------------------------------------------------------------- the runner, in process


@pytest.mark.redis
def test_a_batch_played_in_process_ends_as_its_seeds_say_and_as_one_at_a_time(sessions, null_server):
    server, sha = null_server
    settings = fast_settings()
    one_id, one_ids = _null_evaluation(sessions, server.ws_url, sha, 12, seed0=7_000)
    batch_id, batch_ids = _null_evaluation(sessions, server.ws_url, sha, 12, seed0=7_000)
    try:
        singles = [runner.run_episode_by_id(sessions, i, "w", settings) for i in one_ids]
        # a duplicate id and an unknown one in the message: each id answered once
        played = runner.run_episode_batch(sessions, [*batch_ids[:6], batch_ids[0], 10**12, *batch_ids[6:]], "w",
                                          settings)
    finally:
        runner.close_caches()
    assert [r.episode_id for r in played] == [*batch_ids[:6], 10**12, *batch_ids[6:]]
    assert [r.status for r in played if r.episode_id != 10**12] == [r.status for r in singles]
    assert sum(r.finalised for r in played) == 1
    outcomes = {}
    for evaluation_id in (one_id, batch_id):
        assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
        rows = episodes_of(sessions, evaluation_id)
        assert all(r.attempts == 1 and r.steps == 10 and r.failure_reason is None for r in rows)
        assert [r.success for r in rows] == [seeded_success("null", r.seed) for r in rows]
        outcomes[evaluation_id] = [(r.task, r.seed, r.success, r.steps, r.total_return) for r in rows]
    assert outcomes[one_id] == outcomes[batch_id]
    again = runner.run_episode_batch(sessions, batch_ids, "w", settings)  # a redelivered batch: a no-op
    assert {r.status for r in again} == {"skipped"}


# ---------------------------------------------------------------------------- real workers


@pytest.mark.redis
def test_two_workers_racing_on_duplicate_batches_and_old_messages_play_each_episode_once(
        sessions, null_server, redis_server, start_inflight_worker):
    server, sha = null_server
    evaluation_id, ids = _null_evaluation(sessions, server.ws_url, sha, 200)
    batched = CeleryEpisodeQueue(redis_server.url, episodes_per_message=8)
    old = CeleryEpisodeQueue(redis_server.url, episodes_per_message=1)  # one id per message, as an older API
    workers = [start_inflight_worker(redis_server.url, name, 4, simulators="null") for name in ("racer-a", "racer-b")]
    first, second = ids[:120], ids[120:]
    assert batched.enqueue(first, "null") == 120 and batched.enqueue(first, "null") == 120  # every batch twice
    assert old.enqueue(second, "null") == 80 and batched.enqueue(second, "null") == 80
    wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 180, "the evaluation to finish", step=0.5)
    rows = episodes_of(sessions, evaluation_id)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    assert len(rows) == 200 and {r.attempts for r in rows} == {1}
    assert all(r.failure_reason is None and r.steps == 10 for r in rows)
    assert [r.success for r in rows] == [seeded_success("null", r.seed) for r in rows]
    # Every id was delivered twice: one delivery played it, the other found it taken.
    def skipped() -> int:
        return sum(len(re.findall(r"episode \d+: skipped", w.log_path.read_text(errors="replace"))) for w in workers)

    wait_for(lambda: skipped() >= 200, 60, "every second delivery")
    assert skipped() == 200


@pytest.mark.redis
def test_same_outcomes_with_batching_on_and_off(sessions, null_server, redis_server,
                                                start_inflight_worker):
    server, sha = null_server
    start_inflight_worker(redis_server.url, "both", 4, simulators="null")
    outcomes = {}
    for k in (1, 8):
        evaluation_id, ids = _null_evaluation(sessions, server.ws_url, sha, 60, max_steps=20, seed0=42_000)
        CeleryEpisodeQueue(redis_server.url, episodes_per_message=k).enqueue(ids, "null")
        wait_for(lambda eid=evaluation_id: evaluation(sessions, eid).finalised, 120, f"the K = {k} evaluation")
        rows = episodes_of(sessions, evaluation_id)
        assert all(r.status in ("succeeded", "failed") and r.failure_reason is None for r in rows)
        outcomes[k] = {(r.task, r.seed): (r.success, r.steps, r.total_return) for r in rows}
    assert len(outcomes[1]) == 60 and outcomes[8] == outcomes[1]


@pytest.mark.redis
def test_a_worker_killed_with_a_batch_in_flight_loses_only_its_leases(sessions, null_server, redis_server,
                                                                    start_inflight_worker):
    server, sha = null_server
    steps = 2000  # 500 policy round trips: the kill lands with most of the batch still to play
    evaluation_id, ids = _null_evaluation(sessions, server.ws_url, sha, 16, max_steps=steps)
    victim = start_inflight_worker(redis_server.url, "victim", 1, simulators="null")
    CeleryEpisodeQueue(redis_server.url, episodes_per_message=8).enqueue(ids, "null")
    wait_for(lambda: sum(r.status in ("succeeded", "failed") for r in episodes_of(sessions, evaluation_id)) >= 1,
             120, "the batch's first result")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    before = {r.id: r for r in episodes_of(sessions, evaluation_id)}
    done = {i for i, r in before.items() if r.status in ("succeeded", "failed")}
    held = {i for i, r in before.items() if r.status == "running"}
    assert held, "the kill landed with episodes of the batch still held"
    assert {before[i].worker_id for i in held} == {before[min(done)].worker_id}  # the victim's leases
    start_inflight_worker(redis_server.url, "rescuer", 2, simulators="null")
    with _running_sweeper(sessions, redis_server.url) as sweeper:
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 240, "the evaluation to finish", step=0.5)
    assert held <= set(sweeper.reenqueued) and not done & set(sweeper.reenqueued)
    rows = {r.id: r for r in episodes_of(sessions, evaluation_id)}
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None and r.steps == steps
               for r in rows.values())
    assert all(rows[i].finished_at == before[i].finished_at and rows[i].attempts == 1 for i in done)
    assert all(rows[i].attempts == 2 for i in held), [(i, rows[i].attempts) for i in held]
    assert all(r.attempts == 1 for i, r in rows.items() if i not in held)
    assert [r.success for r in rows.values()] == [seeded_success("null", r.seed) for r in rows.values()]


@pytest.mark.redis
def test_cancelling_mid_batch_closes_what_the_batch_has_not_started(sessions, null_server, redis_server,
                                                                   start_inflight_worker):
    server, sha = null_server
    steps = 2000
    evaluation_id, ids = _null_evaluation(sessions, server.ws_url, sha, 12, max_steps=steps)
    start_inflight_worker(redis_server.url, "cancel", 1, simulators="null")  # heartbeat every 0.5 s (FAST)
    queue = CeleryEpisodeQueue(redis_server.url, episodes_per_message=12)
    assert queue.enqueue(ids, "null") == 12
    wait_for(lambda: sum(r.status in ("succeeded", "failed") for r in episodes_of(sessions, evaluation_id)) >= 1,
             120, "the batch's first result")
    with sessions() as session:
        queries.cancel_evaluation(session, evaluation_id)
    wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 120, "the cancelled evaluation to close")
    rows = episodes_of(sessions, evaluation_id)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.CANCELLED
    played = [r for r in rows if r.status in (EpisodeStatus.SUCCEEDED, EpisodeStatus.FAILED)]
    closed = [r for r in rows if r.status == EpisodeStatus.CANCELLED]
    assert len(played) + len(closed) == 12 and played and closed
    assert all(r.failure_reason is None and r.steps == steps for r in played)  # finished, not cut off
    # claimed by the batch (one attempt) but closed before it started, by the worker itself
    assert all(r.attempts == 1 and r.failure_reason == "cancelled" and r.steps is None for r in closed)
    assert max(r.episode_index for r in played) < min(r.episode_index for r in closed)  # played in order


@pytest.mark.redis
def test_batch_messages_carry_lists_of_ids(redis_server):
    queue = CeleryEpisodeQueue(redis_server.url, queue="episodes-k", episodes_per_message=4)
    assert queue.enqueue(list(range(1, 11)), "null") == 10
    broker = redis.Redis.from_url(redis_server.url)
    raw = [json.loads(m) for m in reversed(broker.lrange("episodes-k.null", 0, -1))]
    bodies = [json.loads(base64.b64decode(m["body"]))[0][0] for m in raw]
    assert [m["headers"]["task"] for m in raw] == [RUN_EPISODES_TASK] * 3
    assert bodies == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
