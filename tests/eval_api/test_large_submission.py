"""A large evaluation answers its 202 before its episode rows exist (issue #23, migration 0013).

An evaluation of more than ``queries.INLINE_EPISODES`` episodes is stored as its plan; its rows are
written after the response in chunks (``queries.materialize_all``), each enqueued after its commit.
These tests lower both thresholds (``INLINE_EPISODES``, ``MATERIALIZE_CHUNK``) so that a few
thousand episodes take several chunks, and check, on PostgreSQL and SQLite with a real Redis queue:
the 202's body, one row per episode with the planned (task, seed, step limit), every one enqueued
once, no finalisation before the last row exists, an idempotent replay, a materialisation cut off
part-way finished by the sweeper, and cancelling part-way.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from benchmarks.suite import evaluation_seed
from services.eval_api.app import create_app
from services.eval_api.planning import plan_evaluation, suites_by_name
from services.eval_api.schemas import EvaluationCreate
from services.eval_api.settings import ApiSettings
from services.queue import CeleryEpisodeQueue, queue_name
from services.store import queries
from services.store.api_keys import create_api_key
from services.store.db import make_session_factory
from services.store.models import (
    Episode,
    EpisodeStatus,
    Evaluation,
    EvaluationStatus,
    FailureReason,
)
from services.workers.settings import WorkerSettings
from services.workers.sweeper import Sweeper
from tests.eval_api.conftest import Api, ScriptedHandshake, metadata
from tests.store.databases import empty_tables

pytestmark = pytest.mark.redis

NULL_ENDPOINT = "ws://null.test/ws"
NULL_STEPS = next(t["max_steps"] for t in suites_by_name()["null"]["tasks"] if t["name"] == "null")


@pytest.fixture
def redis_queue(redis_url) -> Iterator[tuple[CeleryEpisodeQueue, redis.Redis]]:
    """A real Celery producer on the test Redis, on a queue name of this test's own."""
    client = redis.Redis.from_url(redis_url)
    name = f"episodes-large-{secrets.token_hex(4)}"
    queue = CeleryEpisodeQueue(redis_url, name)
    yield queue, client
    client.delete(*(client.keys(f"*{name}*") or [name]))
    client.close()


def queued_ids(client: redis.Redis, queue: CeleryEpisodeQueue, simulator: str = "null") -> list[int]:
    """Every episode id waiting on ``simulator``'s queue, oldest first (a message carries one id, or a list)."""
    ids: list[int] = []
    for raw in reversed(client.lrange(queue_name(simulator, queue.queue), 0, -1)):
        args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
        ids.extend(args[0] if isinstance(args[0], list) else [args[0]])
    return ids


@pytest.fixture
def small_chunks(monkeypatch) -> tuple[int, int]:
    """Deferred above 1,000 episodes, 700 rows per chunk (the defaults are 10,000 and 10,000)."""
    monkeypatch.setattr(queries, "INLINE_EPISODES", 1_000)
    monkeypatch.setattr(queries, "MATERIALIZE_CHUNK", 700)
    return 1_000, 700


def make_api(engine, queue: CeleryEpisodeQueue) -> Iterator[Api]:
    """The API on ``engine`` publishing to ``queue``, with a scripted null policy server's handshake."""
    handshake = ScriptedHandshake({NULL_ENDPOINT: metadata(tasks=("null",), state_dim=4, action_dim=2)})
    app = create_app(ApiSettings(max_episodes_per_evaluation=100_000, max_queued_episodes=1_000_000),
                     engine=engine, episode_queue=queue, handshake=handshake)
    sessions = make_session_factory(engine)
    with sessions() as session:
        _, key = create_api_key(session, "tests")
    with TestClient(app) as client:
        yield Api(app, client, key, queue, handshake, sessions)


@pytest.fixture
def null_api(store_engine, redis_queue) -> Iterator[Api]:
    yield from make_api(store_engine, redis_queue[0])


@pytest.fixture
def pg_null_api(pg_engine, redis_queue) -> Iterator[Api]:
    try:
        yield from make_api(pg_engine, redis_queue[0])
    finally:
        empty_tables(pg_engine)


def evaluation_of(sessions, episode_ids: list[int]) -> int:
    with sessions() as session:
        return session.scalar(select(Episode.evaluation_id).where(Episode.id == episode_ids[0]))


def rows(sessions, evaluation_id: int) -> list[Episode]:
    with sessions() as session:
        return list(session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id)
                                    .order_by(Episode.episode_index)))


def evaluation_row(sessions, evaluation_id: int) -> Evaluation:
    with sessions() as session:
        evaluation = session.get(Evaluation, evaluation_id)
        assert evaluation is not None
        return evaluation


def play(sessions, episode_ids: list[int]) -> None:
    """Claim and finish these episodes, as a worker would (without the finalisation check)."""
    with sessions() as session:
        for episode_id in episode_ids:
            assert queries.claim_episode(session, episode_id, "worker-1", 60)
            assert queries.finish_episode(session, episode_id, success=episode_id % 2 == 0, steps=10)


def assert_planned(episodes: list[Episode], total: int, seed: int) -> None:
    """One row per index 0 … total - 1, each with the task, seed and step limit the planner gives it."""
    assert [e.episode_index for e in episodes] == list(range(total))
    assert [(e.task, e.seed, e.max_steps) for e in episodes] == [
        ("null", evaluation_seed(seed + i), NULL_STEPS) for i in range(total)]


@pytest.mark.postgres
def test_a_large_submission_answers_first_and_writes_every_episode_once(pg_null_api, redis_queue, monkeypatch):
    total = 30_000
    api, (queue, broker) = pg_null_api, redis_queue
    monkeypatch.setattr(queries, "INLINE_EPISODES", 10_000)
    monkeypatch.setattr(queries, "MATERIALIZE_CHUNK", 1_200)  # 25 chunks
    policy = api.register_policy("null", NULL_ENDPOINT, tasks=("null",), state_dim=4, action_dim=2)
    chunks: list[list[int]] = []
    finalised_early: list[bool] = []
    publish = queue.enqueue

    def enqueue_then_play_the_first_chunk(episode_ids, simulator=None):
        sent = publish(episode_ids, simulator)
        chunks.append(list(episode_ids))
        if len(chunks) == 1:
            # Every row written so far ends before the next chunk exists: that must not finish it.
            play(api.sessions, list(episode_ids))
            with api.sessions() as session:
                finalised_early.append(queries.finalize_evaluation_if_done(
                    session, evaluation_of(api.sessions, episode_ids)))
        return sent

    queue.enqueue = enqueue_then_play_the_first_chunk  # the real producer, watched
    response = api.client.post("/evaluations", headers={**api.auth, "Idempotency-Key": "big-1"}, json={
        "policy_id": policy["id"], "suite": "null", "episodes_per_task": total, "seed": 3})
    assert response.status_code == 202, response.text
    body = response.json()
    evaluation_id = body["id"]
    assert response.headers["Location"] == f"/evaluations/{evaluation_id}"
    assert body["status"] == "pending" and body["episodes_total"] == total
    assert body["counts"]["pending"] == total and sum(body["counts"].values()) == total
    assert body["overall"]["episodes"] == total and body["overall"]["scored"] == 0
    assert [(t["task"], t["episodes"]) for t in body["per_task"]] == [("null", total)]

    # TestClient returns once the background materialisation has run.
    episodes = rows(api.sessions, evaluation_id)
    assert_planned(episodes, total, seed=3)
    assert [len(c) for c in chunks] == [1_200] * 25
    assert finalised_early == [False]
    assert queued_ids(broker, queue) == [e.id for e in episodes]  # each enqueued once, in order
    evaluation = evaluation_row(api.sessions, evaluation_id)
    assert evaluation.episodes_unmaterialized == 0 and evaluation.finished_at is None

    live = api.client.get(f"/evaluations/{evaluation_id}", headers=api.auth).json()
    assert live["counts"]["succeeded"] + live["counts"]["failed"] == 1_200
    assert live["counts"]["pending"] == total - 1_200

    replay = api.client.post("/evaluations", headers={**api.auth, "Idempotency-Key": "big-1"}, json={
        "policy_id": policy["id"], "suite": "null", "episodes_per_task": total, "seed": 3})
    assert replay.status_code == 202 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == evaluation_id
    assert len(rows(api.sessions, evaluation_id)) == total and len(chunks) == 25  # nothing new written or sent

    play(api.sessions, [e.id for e in episodes[1_200:1_300]])
    with api.sessions() as session:
        assert not queries.finalize_evaluation_if_done(session, evaluation_id)
        # The workers end the rest (one statement here, not 28,700 claims: the path is the same as above).
        session.execute(update(Episode).where(Episode.evaluation_id == evaluation_id,
                                              Episode.status == EpisodeStatus.PENDING.value)
                        .values(status=EpisodeStatus.FAILED.value, success=False, steps=10))
        session.commit()
        assert queries.finalize_evaluation_if_done(session, evaluation_id)
    with api.sessions() as session:
        assert not queries.finalize_evaluation_if_done(session, evaluation_id)  # once only
    done = api.client.get(f"/evaluations/{evaluation_id}", headers=api.auth).json()
    assert done["status"] == "finished" and done["overall"]["episodes"] == total
    assert done["overall"]["scored"] == total and done["counts"]["pending"] == 0


def test_small_chunks_on_each_backend(null_api, redis_queue, small_chunks):
    """The same on SQLite (the embedded default) and PostgreSQL, and a small evaluation keeps the old path."""
    api, (queue, broker) = null_api, redis_queue
    policy = api.register_policy("null", NULL_ENDPOINT, tasks=("null",), state_dim=4, action_dim=2)

    small = api.submit(policy["id"], suite="null", episodes_per_task=1_000, seed=0)
    assert evaluation_row(api.sessions, small["id"]).episodes_unmaterialized == 0
    assert_planned(rows(api.sessions, small["id"]), 1_000, seed=0)

    big = api.submit(policy["id"], suite="null", episodes_per_task=2_500, seed=11)
    assert big["counts"]["pending"] == 2_500
    episodes = rows(api.sessions, big["id"])
    assert_planned(episodes, 2_500, seed=11)
    assert queued_ids(broker, queue) == [e.id for e in rows(api.sessions, small["id"])] + [e.id for e in episodes]


def deferred_evaluation(sessions, episodes: int, *, seed: int = 0) -> int:
    """An evaluation planned as the API plans it and stored deferred, with no episode row yet (the
    moment after its 202)."""
    with sessions() as session:
        policy = queries.find_policy(session, "null", "1") or queries.create_policy(
            session, name="null", version="1", endpoint=NULL_ENDPOINT, checkpoint_sha256=None, state_dim=4,
            action_dim=2, chunk_size=4, tasks=["null"])
        request = EvaluationCreate(policy_id=policy.id, suite="null", episodes_per_task=episodes, seed=seed)
        plan = plan_evaluation(request, policy, max_episodes=episodes)
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite="null", tasks=plan.tasks, episodes_per_task=episodes, seed=seed,
            max_steps=None, standard=plan.standard, tags=[], episodes=plan.episodes, protocol=plan.protocol,
            definition_hash=plan.definition_hash)
        assert created.episode_ids == [] and created.evaluation.episodes_unmaterialized == episodes
        return created.evaluation.id


def test_the_sweeper_finishes_a_materialisation_cut_off_part_way(store_engine, redis_queue, small_chunks):
    queue, broker = redis_queue
    sessions = make_session_factory(store_engine)
    evaluation_id = deferred_evaluation(sessions, 2_500, seed=5)
    with sessions() as session:  # the API wrote one chunk and died before enqueuing it
        first = queries.materialize_episodes(session, evaluation_id)
    assert first is not None and len(first) == 700
    with sessions() as session:
        assert not queries.finalize_evaluation_if_done(session, evaluation_id)
        assert queries.unfinalised_evaluation_ids(session) == []

    # Before pending_after_s the API may still be at it: the sweeper leaves it alone.
    Sweeper(sessions, queue, WorkerSettings(pending_after_s=3600)).sweep_once()
    assert len(rows(sessions, evaluation_id)) == 700 and queued_ids(broker, queue) == []

    time.sleep(0.05)  # older than pending_after_s below
    report = Sweeper(sessions, queue, WorkerSettings(pending_after_s=0.01)).sweep_once()
    assert report.materialized == [evaluation_id]
    episodes = rows(sessions, evaluation_id)
    assert_planned(episodes, 2_500, seed=5)
    assert evaluation_row(sessions, evaluation_id).episodes_unmaterialized == 0
    # The rest enqueued as written; the chunk the API never sent re-enqueued as stale pending rows.
    assert sorted(queued_ids(broker, queue)) == [e.id for e in episodes]
    assert set(report.reenqueued) == set(first)

    play(sessions, [e.id for e in episodes])
    with sessions() as session:
        assert queries.finalize_evaluation_if_done(session, evaluation_id)
    assert evaluation_row(sessions, evaluation_id).status == EvaluationStatus.FINISHED


def test_cancelling_part_way_writes_the_rest_cancelled_and_closes(null_api, redis_queue, small_chunks):
    api, (queue, broker) = null_api, redis_queue
    policy = api.register_policy("null", NULL_ENDPOINT, tasks=("null",), state_dim=4, action_dim=2)
    chunks: list[list[int]] = []
    publish = queue.enqueue

    def enqueue_then_cancel(episode_ids, simulator=None):
        sent = publish(episode_ids, simulator)
        chunks.append(list(episode_ids))
        if len(chunks) == 1:  # a worker takes one episode, then its owner cancels mid-materialisation
            with api.sessions() as session:
                assert queries.claim_episode(session, episode_ids[0], "worker-1", 60)
                queries.cancel_evaluation(session, evaluation_of(api.sessions, episode_ids))
        return sent

    queue.enqueue = enqueue_then_cancel
    body = api.submit(policy["id"], suite="null", episodes_per_task=2_500, seed=0)
    episodes = rows(api.sessions, body["id"])
    assert len(chunks) == 1 and queued_ids(broker, queue) == chunks[0]  # nothing enqueued after the cancel
    assert [e.episode_index for e in episodes] == list(range(2_500))
    statuses = {e.status for e in episodes[1:]}
    assert statuses == {EpisodeStatus.CANCELLED.value}
    assert {e.failure_reason for e in episodes[1:]} == {FailureReason.CANCELLED.value}
    evaluation = evaluation_row(api.sessions, body["id"])
    assert evaluation.status == EvaluationStatus.CANCELLED and evaluation.finished_at is None  # one still runs

    with api.sessions() as session:  # the running episode ends, as cancelling promises
        assert queries.finish_episode(session, episodes[0].id, success=True, steps=10)
        assert queries.finalize_evaluation_if_done(session, body["id"])
    done = api.client.get(f"/evaluations/{body['id']}", headers=api.auth).json()
    assert done["status"] == "cancelled" and done["finished_at"] is not None
    assert done["counts"]["cancelled"] == 2_499 and done["counts"]["succeeded"] == 1


def test_cancelling_before_any_row_exists_through_the_api(null_api, redis_queue, small_chunks):
    api, (queue, broker) = null_api, redis_queue
    evaluation_id = deferred_evaluation(api.sessions, 2_000)
    with api.sessions() as session:  # owned by no key: an admin's cancel
        assert queries.get_evaluation(session, evaluation_id).created_by_key_id is None
    with api.sessions() as session:
        _, admin = create_api_key(session, "admin", "admin")
    response = api.client.post(f"/evaluations/{evaluation_id}/cancel", headers={"Authorization": f"Bearer {admin}"})
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "cancelled"
    assert sum(response.json()["counts"].values()) == 2_000
    # After the response, the rows were written cancelled and the evaluation closed.
    episodes = rows(api.sessions, evaluation_id)
    assert [e.episode_index for e in episodes] == list(range(2_000))
    assert {e.status for e in episodes} == {EpisodeStatus.CANCELLED.value}
    evaluation = evaluation_row(api.sessions, evaluation_id)
    assert evaluation.finished_at is not None and evaluation.episodes_unmaterialized == 0
    assert queued_ids(broker, queue) == []


def test_materialising_is_idempotent_per_chunk(store_engine, small_chunks):
    """Two materialisers (the API's and the sweeper's) never write a row twice: the chunk count is a
    conditional update and the insert skips existing indexes."""
    sessions = make_session_factory(store_engine)
    evaluation_id = deferred_evaluation(sessions, 1_500)
    with sessions() as a, sessions() as b:
        written = [queries.materialize_episodes(a, evaluation_id), queries.materialize_episodes(b, evaluation_id),
                   queries.materialize_episodes(a, evaluation_id), queries.materialize_episodes(b, evaluation_id)]
    assert [len(ids) if ids is not None else None for ids in written] == [700, 700, 100, None]
    assert_planned(rows(sessions, evaluation_id), 1_500, seed=0)


def test_the_queue_cap_counts_episodes_not_written_yet(store_engine, small_chunks):
    """EVALFORGE_MAX_QUEUED_EPISODES counts a large evaluation's episodes before their rows exist:
    otherwise a client could pile up any number of them in the 202s before materialisation."""
    from services.eval_api.admission import check_queue_cap, queued_episodes
    from services.eval_api.errors import ApiError

    sessions = make_session_factory(store_engine)
    evaluation_id = deferred_evaluation(sessions, 2_500)
    with sessions() as session:
        assert queued_episodes(session) == 2_500
        queries.materialize_episodes(session, evaluation_id)  # 700 rows pending, 1,800 still unwritten
    with sessions() as session:
        assert queued_episodes(session) == 2_500
        with pytest.raises(ApiError) as refused:
            check_queue_cap(session, 1, max_queued=2_500)
        assert refused.value.details["queued_episodes"] == 2_500
        check_queue_cap(session, 0, max_queued=2_500)
