"""Claim, finish, finalise and cancel under real concurrency: threads with their own
connections, racing through barriers, against PostgreSQL (the production backend) and
SQLite (the embedded one, where BEGIN IMMEDIATE serialises the writers)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from services.store import queries
from services.store.api_keys import create_api_key
from services.store.db import make_session_factory
from services.store.models import Episode, Evaluation
from tests.store.helpers import add_evaluation, add_policy

THREADS = 8


@pytest.fixture
def factory(store_engine):
    return make_session_factory(store_engine)


def race(factory, jobs: list[Callable]) -> list:
    """Run each job(session) in its own thread and session, all released at once."""
    barrier = threading.Barrier(len(jobs))

    def run(job: Callable):
        with factory() as session:
            barrier.wait()
            return job(session)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def test_exactly_one_claimer_wins(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=10)
    for episode_id in created.episode_ids:
        results = race(factory, [lambda s, w=w, e=episode_id: queries.claim_episode(s, e, f"w{w}", 60)
                                 for w in range(THREADS)])
        assert results.count(True) == 1, results
    with factory() as session:
        episodes = session.scalars(select(Episode)).all()
        assert {e.attempts for e in episodes} == {1} and {e.status for e in episodes} == {"running"}
        assert session.get(Evaluation, created.evaluation.id).status == "running"


def test_exactly_one_result_is_written(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=5)
    for episode_id in created.episode_ids:
        jobs = [lambda s, w=w, e=episode_id: (w, queries.finish_episode(s, e, success=w % 2 == 0, steps=w + 1))
                for w in range(THREADS)]
        results = race(factory, jobs)
        winners = [w for w, written in results if written]
        assert len(winners) == 1
        with factory() as session:
            episode = session.get(Episode, episode_id)
            assert episode.steps == winners[0] + 1 and episode.success == (winners[0] % 2 == 0)


def test_finalize_exactly_once_when_the_last_episodes_finish_together(factory):
    for round_ in range(5):
        with factory() as session:
            created = add_evaluation(session, add_policy(session, version=f"v{round_}"), per_task=THREADS // 2)
        ids = created.episode_ids
        assert len(ids) == THREADS

        def worker(session, episode_id, evaluation_id=created.evaluation.id):
            assert queries.claim_episode(session, episode_id, f"w{episode_id}", 60)
            queries.finish_episode(session, episode_id, success=episode_id % 3 == 0, steps=10)
            return queries.finalize_evaluation_if_done(session, evaluation_id)

        results = race(factory, [lambda s, e=e: worker(s, e) for e in ids])
        assert results.count(True) == 1, results
        with factory() as session:
            evaluation = session.get(Evaluation, created.evaluation.id)
            assert evaluation.status == "finished"
            assert evaluation.episodes_succeeded == sum(1 for e in ids if e % 3 == 0)
            assert evaluation.episodes_scored == THREADS


def test_finalize_exactly_once_when_everyone_calls_it(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=1)
        for episode_id in created.episode_ids:
            queries.finish_episode(session, episode_id, success=True, steps=3)
    results = race(factory, [lambda s: queries.finalize_evaluation_if_done(s, created.evaluation.id)] * THREADS)
    assert results.count(True) == 1


def test_cancel_racing_claims_never_deadlocks(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=40)
    ids = created.episode_ids
    chunks = [ids[i::THREADS - 1] for i in range(THREADS - 1)]

    def claimer(session, chunk):
        return sum(queries.claim_episode(session, e, "w", 60) for e in chunk)

    jobs = [lambda s, c=c: claimer(s, c) for c in chunks]
    jobs.append(lambda s: queries.cancel_evaluation(s, created.evaluation.id).status)
    results = race(factory, jobs)  # a deadlock would raise here
    assert results[-1] == "cancelled"
    with factory() as session:
        statuses = [e.status for e in session.scalars(select(Episode))]
        assert set(statuses) <= {"running", "cancelled"}
        assert statuses.count("running") == sum(results[:-1])
        for episode in session.scalars(select(Episode).where(Episode.status == "running")):
            queries.finish_episode(session, episode.id, success=True, steps=1)
        queries.finalize_evaluation_if_done(session, created.evaluation.id)
        evaluation = session.get(Evaluation, created.evaluation.id)
        session.refresh(evaluation)
        assert evaluation.status == "cancelled" and evaluation.finished_at is not None


def test_one_idempotency_key_creates_one_evaluation(factory):
    with factory() as session:
        policy = add_policy(session)
        key_id = create_api_key(session, "racer")[0].id

    def submit(session):
        return add_evaluation(session, policy, idempotency_key="retry-me", request_sha256="c" * 64,
                              created_by_key_id=key_id)

    results = race(factory, [submit] * THREADS)
    assert sum(r.created for r in results) == 1
    assert len({r.evaluation.id for r in results}) == 1
    with factory() as session:
        assert session.scalars(select(Evaluation)).all().__len__() == 1
        assert len(session.scalars(select(Episode)).all()) == 4


def test_an_idempotency_key_without_an_api_key_is_refused(factory):
    """NULL key ids never collide in the (API key, idempotency key) unique index, so the store refuses
    the combination rather than let racing submissions both be created."""
    with factory() as session:
        policy = add_policy(session)
        with pytest.raises(ValueError, match="belongs to an API key"):
            add_evaluation(session, policy, idempotency_key="no-key")
