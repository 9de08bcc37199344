"""The worker's one-statement claim (``queries.claim_running_episode``) and the finalisation
check's partial index (migration 0012), on both backends."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text, update

from services.store import queries
from services.store.db import make_session_factory
from services.store.models import Episode, Evaluation, Policy, utcnow
from tests.store.databases import empty_tables
from tests.store.helpers import add_evaluation, add_policy

COLUMNS = (Episode.evaluation_id, Episode.attempts, Episode.seed, Evaluation.suite, Policy.endpoint)


@pytest.fixture
def factory(store_engine):
    return make_session_factory(store_engine)


def _episode(session, episode_id: int) -> Episode:
    session.expire_all()
    return session.get(Episode, episode_id)


def test_claims_an_episode_of_a_running_evaluation_and_reads_its_job(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=3)
        first, second, third, *_ = created.episode_ids
        assert queries.claim_episode(session, first, "w0", 60)  # the evaluation's first claim: it is running now
        row = queries.claim_running_episode(session, second, "w1", 60, COLUMNS, max_attempts=3)
        if session.get_bind().dialect.name != "postgresql":
            assert row is None  # SQLite: left to claim_episode, nothing changed
            assert _episode(session, second).status == "pending"
            return
        assert row is not None
        assert (row.evaluation_id, row.attempts, row.suite, row.endpoint) == (
            created.evaluation.id, 1, "metaworld-mt10", "ws://127.0.0.1:1/ws")
        episode = _episode(session, second)
        assert (episode.status, episode.worker_id, episode.attempts) == ("running", "w1", 1)
        assert row.seed == episode.seed
        # Held by w1 with a live lease: nobody else claims it, and nothing changes.
        assert queries.claim_running_episode(session, second, "w2", 60, COLUMNS, max_attempts=3) is None
        assert _episode(session, second).worker_id == "w1"
        # An expired lease is claimable again (attempt 2), until the attempts are spent.
        session.execute(update(Episode).where(Episode.id == second)
                        .values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
        assert queries.claim_running_episode(session, second, "w2", 60, COLUMNS, max_attempts=3).attempts == 2
        session.execute(update(Episode).where(Episode.id == second)
                        .values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
        assert queries.claim_running_episode(session, second, "w3", 60, COLUMNS, max_attempts=2) is None
        assert _episode(session, second).worker_id == "w2"
        # A cancelled evaluation's episodes are not claimed.
        queries.cancel_evaluation(session, created.evaluation.id)
        session.execute(update(Episode).where(Episode.id == third).values(status="pending"))
        session.commit()
        assert queries.claim_running_episode(session, third, "w1", 60, COLUMNS, max_attempts=3) is None
        assert _episode(session, third).status == "pending"


def test_leaves_an_evaluations_first_claim_to_claim_episode(factory):
    with factory() as session:
        created = add_evaluation(session, add_policy(session), per_task=1)
        episode_id = created.episode_ids[0]
        assert queries.claim_running_episode(session, episode_id, "w1", 60, COLUMNS) is None
        assert _episode(session, episode_id).status == "pending"
        session.expire_all()
        assert session.get(Evaluation, created.evaluation.id).status == "pending"


@pytest.mark.postgres
def test_the_finalisation_check_reads_the_live_episodes_index(pg_engine):
    factory = make_session_factory(pg_engine)
    try:
        with factory() as session:
            created = add_evaluation(session, add_policy(session, name="index"), per_task=50)
            session.execute(text("SET LOCAL enable_seqscan = off"))
            plan = "\n".join(session.scalars(text(
                "EXPLAIN SELECT id FROM episodes WHERE evaluation_id = :id AND status IN ('pending', 'running') "
                "LIMIT 1"), {"id": created.evaluation.id}))
            session.rollback()
    finally:
        empty_tables(pg_engine)  # the next test's store starts empty
    assert "ix_episodes_live_evaluation_id" in plan, plan
