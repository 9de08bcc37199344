"""The store's queries on SQLite and PostgreSQL: create, claim, finish, finalise, cancel, list, rank."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from services.store import api_keys, queries
from services.store.aggregates import wilson_interval
from services.store.db import make_session_factory
from services.store.models import Episode, Evaluation, utcnow
from tests.store.helpers import TASKS, add_evaluation, add_policy, run_all


@pytest.fixture
def session(store_engine):
    with make_session_factory(store_engine)() as session:
        yield session


def test_create_evaluation_writes_every_episode_in_order(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=3, tags=("nightly", "baseline", "nightly"))
    assert created.created and len(created.episode_ids) == 6
    episodes = session.scalars(select(Episode).order_by(Episode.episode_index)).all()
    assert [e.id for e in episodes] == created.episode_ids  # RETURNING in insertion order
    assert [(e.task, e.seed) for e in episodes] == [(t, 1_000_000 + i) for t in TASKS for i in range(3)]
    assert {e.status for e in episodes} == {"pending"} and {e.attempts for e in episodes} == {0}
    evaluation = queries.get_evaluation(session, created.evaluation.id)
    assert evaluation.tags == ["baseline", "nightly"] and evaluation.episodes_total == 6
    assert evaluation.status == "pending" and evaluation.created_at.tzinfo is not None


def test_episode_rows_are_unique_per_evaluation_and_index(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy)
    session.add(Episode(evaluation_id=created.evaluation.id, episode_index=0, task="reach-v3", seed=1,
                        max_steps=5, status="pending", attempts=0))
    with pytest.raises(IntegrityError):
        session.commit()
    session.rollback()


def test_idempotency_key_replays_or_conflicts(session):
    policy = add_policy(session)
    key = api_keys.create_api_key(session, "retrier")[0].id
    first = add_evaluation(session, policy, idempotency_key="k1", request_sha256="a" * 64, created_by_key_id=key)
    again = add_evaluation(session, policy, idempotency_key="k1", request_sha256="a" * 64, created_by_key_id=key)
    assert not again.created and again.evaluation.id == first.evaluation.id and again.episode_ids == []
    with pytest.raises(queries.IdempotencyConflict, match="different request body") as info:
        add_evaluation(session, policy, idempotency_key="k1", request_sha256="b" * 64, created_by_key_id=key)
    assert info.value.evaluation_id == first.evaluation.id
    assert session.scalar(select(func.count()).select_from(Evaluation)) == 1
    assert session.scalar(select(func.count()).select_from(Episode)) == 4


def test_claim_is_conditional_and_counts_attempts(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy)
    episode_id = created.episode_ids[0]
    now = utcnow()
    assert queries.claim_episode(session, episode_id, "worker-a", 30, now=now)
    assert not queries.claim_episode(session, episode_id, "worker-b", 30, now=now + timedelta(seconds=10))
    episode = session.get(Episode, episode_id)
    session.refresh(episode)
    assert (episode.status, episode.worker_id, episode.attempts) == ("running", "worker-a", 1)
    assert episode.lease_expires_at == pytest.approx(now + timedelta(seconds=30), abs=timedelta(milliseconds=1))
    evaluation = queries.get_evaluation(session, created.evaluation.id)
    session.refresh(evaluation)
    assert evaluation.status == "running" and evaluation.started_at is not None

    # The lease expired: worker-a is presumed dead and worker-b takes over.
    assert queries.claim_episode(session, episode_id, "worker-b", 30, now=now + timedelta(seconds=31))
    session.refresh(episode)
    assert (episode.worker_id, episode.attempts) == ("worker-b", 2)
    # A cap on attempts stops a poison episode from being retried forever.
    assert not queries.claim_episode(session, episode_id, "worker-c", 30, max_attempts=2,
                                     now=now + timedelta(seconds=100))
    assert not queries.claim_episode(session, 999_999, "worker-a", 30)


def test_extend_lease_only_for_the_holder(session):
    policy = add_policy(session)
    episode_id = add_evaluation(session, policy).episode_ids[0]
    now = utcnow()
    assert not queries.extend_lease(session, episode_id, "worker-a", 30)  # not claimed yet
    assert queries.claim_episode(session, episode_id, "worker-a", 30, now=now)
    assert queries.extend_lease(session, episode_id, "worker-a", 300, now=now + timedelta(seconds=20))
    # The extended lease protects the episode from a claim that the old lease would have allowed.
    assert not queries.claim_episode(session, episode_id, "worker-b", 30, now=now + timedelta(seconds=60))
    assert not queries.extend_lease(session, episode_id, "worker-b", 30)
    queries.finish_episode(session, episode_id, success=True, steps=3)
    assert not queries.extend_lease(session, episode_id, "worker-a", 30)


def test_finish_writes_once(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy)
    episode_id = created.episode_ids[0]
    assert queries.claim_episode(session, episode_id, "w", 30)
    assert queries.finish_episode(session, episode_id, success=True, total_return=3.5, steps=42, duration_s=1.2,
                                  latency_mean_ms=8.0, latency_p95_ms=11.0)
    # A redelivered task's second write, even with another outcome, changes nothing.
    assert not queries.finish_episode(session, episode_id, success=False, steps=500,
                                      failure_reason="policy_timeout")
    episode = session.get(Episode, episode_id)
    session.refresh(episode)
    assert (episode.status, episode.success, episode.steps, episode.failure_reason) == ("succeeded", True, 42, None)
    assert episode.lease_expires_at is None and episode.finished_at is not None
    # A finished episode cannot be claimed again.
    assert not queries.claim_episode(session, episode_id, "w2", 30, now=utcnow() + timedelta(hours=1))
    with pytest.raises(ValueError, match="cannot have failure reason"):
        queries.finish_episode(session, created.episode_ids[1], success=True, failure_reason="env_error")
    with pytest.raises(ValueError):
        queries.finish_episode(session, created.episode_ids[1], success=False, failure_reason="gremlins")


def test_finalize_once_with_aggregates(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=4)
    ids = created.episode_ids
    run_all(session, ids[:-1], successes={ids[0], ids[1], ids[2], ids[4]})
    assert not queries.finalize_evaluation_if_done(session, created.evaluation.id)  # one still pending
    assert queries.claim_episode(session, ids[-1], "w", 30)
    queries.finish_episode(session, ids[-1], success=False, failure_reason="env_error", error_message="boom")
    assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
    assert not queries.finalize_evaluation_if_done(session, created.evaluation.id)

    evaluation = queries.get_evaluation(session, created.evaluation.id)
    session.refresh(evaluation)
    assert evaluation.status == "finished" and evaluation.finished_at is not None
    # 7 scored (the env_error one is not), 4 succeeded.
    assert (evaluation.episodes_scored, evaluation.episodes_succeeded) == (7, 4)
    assert evaluation.success_rate == pytest.approx(4 / 7)
    assert (evaluation.success_ci_low, evaluation.success_ci_high) == pytest.approx(wilson_interval(4, 7))
    results = queries.evaluation_results(session, evaluation)
    assert results["counts"]["succeeded"] == 4 and results["counts"]["failed"] == 4
    per_task = {row["task"]: row for row in results["per_task"]}
    assert per_task["reach-v3"]["success_rate"] == 0.75 and per_task["push-v3"]["scored"] == 3
    assert results["overall"]["failure_reasons"] == {"env_error": 1}


def test_an_evaluation_with_no_scored_episode_fails(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=1)
    for episode_id in created.episode_ids:
        queries.finish_episode(session, episode_id, success=False, failure_reason="worker_lost")
    assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
    evaluation = queries.get_evaluation(session, created.evaluation.id)
    session.refresh(evaluation)
    assert evaluation.status == "failed" and evaluation.success_rate is None


def test_cancel(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=2)
    ids = created.episode_ids
    assert queries.claim_episode(session, ids[0], "w", 30)
    evaluation = queries.cancel_evaluation(session, created.evaluation.id)
    assert evaluation.status == "cancelled" and evaluation.cancelled_at is not None
    assert evaluation.finished_at is None  # one episode still running
    statuses = dict(session.execute(select(Episode.id, Episode.status)).all())
    assert statuses == {ids[0]: "running", ids[1]: "cancelled", ids[2]: "cancelled", ids[3]: "cancelled"}
    assert not queries.claim_episode(session, ids[1], "w", 30)  # cancelled episodes are not claimable
    assert queries.cancel_evaluation(session, created.evaluation.id).status == "cancelled"  # twice is fine

    queries.finish_episode(session, ids[0], success=True, steps=10)  # the running one completes
    assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
    evaluation = queries.get_evaluation(session, created.evaluation.id)
    session.refresh(evaluation)
    assert evaluation.status == "cancelled" and evaluation.finished_at is not None
    assert evaluation.aggregates["counts"]["cancelled"] == 3

    done = add_evaluation(session, policy, per_task=1)
    run_all(session, done.episode_ids)
    queries.finalize_evaluation_if_done(session, done.evaluation.id)
    with pytest.raises(queries.EvaluationAlreadyDone, match="already finished"):
        queries.cancel_evaluation(session, done.evaluation.id)
    with pytest.raises(queries.NotFound):
        queries.cancel_evaluation(session, 123_456)


def test_cancel_with_nothing_running_finalises_at_once(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=1)
    evaluation = queries.cancel_evaluation(session, created.evaluation.id)
    assert evaluation.status == "cancelled" and evaluation.finished_at is not None


def test_list_evaluations_filters_and_pages(session):
    a, b = add_policy(session, "a"), add_policy(session, "b")
    ids = []
    for i in range(5):
        ids.append(add_evaluation(session, a if i % 2 == 0 else b, per_task=1,
                                  suite="metaworld-mt10" if i < 3 else "metaworld-mt50",
                                  tags=("nightly",) if i in (1, 4) else ()).evaluation.id)
    assert [e.id for e in queries.list_evaluations(session)] == ids[::-1]
    assert [e.id for e in queries.list_evaluations(session, policy_id=a.id)] == [ids[4], ids[2], ids[0]]
    assert [e.id for e in queries.list_evaluations(session, suite="metaworld-mt50")] == [ids[4], ids[3]]
    assert [e.id for e in queries.list_evaluations(session, tag="nightly")] == [ids[4], ids[1]]
    assert [e.id for e in queries.list_evaluations(session, tag="nightly", policy_id=b.id)] == [ids[1]]
    assert queries.list_evaluations(session, status="finished") == []
    page1 = queries.list_evaluations(session, limit=2)
    page2 = queries.list_evaluations(session, limit=2, before_id=page1[-1].id)
    assert [e.id for e in page1 + page2] == ids[::-1][:4]


def test_list_episodes_pages_in_index_order(session):
    policy = add_policy(session)
    created = add_evaluation(session, policy, per_task=5)
    first = queries.list_episodes(session, created.evaluation.id, limit=4)
    rest = queries.list_episodes(session, created.evaluation.id, after_index=first[-1].episode_index, limit=100)
    assert [e.episode_index for e in first + rest] == list(range(10))
    run_all(session, created.episode_ids[:2], successes={created.episode_ids[0]})
    assert [e.id for e in queries.list_episodes(session, created.evaluation.id, status="succeeded")] == \
        [created.episode_ids[0]]


def test_leaderboard_pools_each_policys_finished_standard_evaluations(session):
    def finished(policy, successes: int, per_task: int = 5, **kwargs):
        created = add_evaluation(session, policy, per_task=per_task, **kwargs)
        run_all(session, created.episode_ids, successes=set(created.episode_ids[:successes]))
        assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
        return created.evaluation.id

    a, b, c, d = (add_policy(session, name) for name in "abcd")
    a_worse = finished(a, 4)  # 40%
    a_better = finished(a, 8)  # 80%: pooled with the 40%, a is at 12 of 20
    b_best = finished(b, 9)  # 90%
    c_small = finished(c, 2, per_task=1)  # 100% of 2 episodes
    c_big = finished(c, 10)  # 100% of 10: pooled, 12 of 12
    finished(d, 10, tasks=("reach-v3",), per_task=10, standard=False)  # a subset: not standard
    add_evaluation(session, d, per_task=50)  # unfinished: never ranked
    finished(a, 10, suite="metaworld-mt50")  # another suite

    board = queries.leaderboard(session, "metaworld-mt10")
    assert [(e.rank, e.policy.name, e.evaluation_ids) for e in board] == \
        [(1, "c", [c_small, c_big]), (2, "b", [b_best]), (3, "a", [a_worse, a_better])]
    assert (board[0].episodes, board[0].successes, board[0].success_rate) == (12, 12, 1.0)
    assert (board[2].episodes, board[2].successes) == (20, 12)
    assert (board[2].ci_low, board[2].ci_high) == pytest.approx(wilson_interval(12, 20))
    with_subsets = queries.leaderboard(session, "metaworld-mt10", include_nonstandard=True)
    assert [e.policy.name for e in with_subsets] == ["c", "d", "b", "a"]  # d: 100% of 10, fewer than c's 12
    assert queries.leaderboard(session, "metaworld-mt10", limit=1)[0].policy.name == "c"
    assert queries.leaderboard(session, "pusht") == []


def test_api_keys(session):
    row, plaintext = api_keys.create_api_key(session, "ci")
    assert plaintext.startswith("efk_") and len(plaintext) > 40 and row.prefix == plaintext[:12]
    assert row.key_sha256 == api_keys.hash_key(plaintext) and plaintext not in row.key_sha256
    assert api_keys.authenticate(session, plaintext).id == row.id
    assert api_keys.authenticate(session, plaintext + "x") is None
    api_keys.revoke_api_key(session, row.id)
    assert api_keys.authenticate(session, plaintext) is None
    assert [k.name for k in api_keys.list_api_keys(session)] == ["ci"]
    assert api_keys.list_api_keys(session, include_revoked=False) == []
    with pytest.raises(queries.NotFound):
        api_keys.revoke_api_key(session, 4242)
    with pytest.raises(ValueError, match="non-empty name"):
        api_keys.create_api_key(session, "  ")


def test_ensure_api_key_takes_the_deployments_key_else_reuses_or_writes_the_file(session, tmp_path):
    key_file = tmp_path / "stack" / "api-key"
    made = api_keys.ensure_api_key(session, key_file, "compose")  # nothing yet: a new key, written
    assert key_file.read_text().strip() == made and (key_file.stat().st_mode & 0o777) == 0o600
    assert api_keys.authenticate(session, made) is not None
    assert api_keys.ensure_api_key(session, key_file, "compose") == made  # reused while the store accepts it
    api_keys.revoke_api_key(session, api_keys.authenticate(session, made).id)
    replaced = api_keys.ensure_api_key(session, key_file, "compose")
    assert replaced != made and key_file.read_text().strip() == replaced

    secret = "efk_" + "A" * 43  # a deployment's own key ($EVALFORGE_API_KEY): registered once, file untouched
    assert api_keys.ensure_api_key(session, key_file, "compose", secret) == secret
    assert api_keys.ensure_api_key(session, key_file, "compose", secret) == secret
    assert api_keys.authenticate(session, secret).name == "compose"
    assert sum(k.name == "compose" for k in api_keys.list_api_keys(session)) == 3
    assert key_file.read_text().strip() == replaced
    with pytest.raises(ValueError, match="is not of the form efk_"):
        api_keys.ensure_api_key(session, key_file, "compose", "hunter2")
    api_keys.revoke_api_key(session, api_keys.authenticate(session, secret).id)
    with pytest.raises(ValueError, match="revoked"):
        api_keys.ensure_api_key(session, key_file, "compose", secret)


def test_policy_name_and_version_are_unique(session):
    add_policy(session, "p", "v1")
    with pytest.raises(queries.Conflict, match="already registered"):
        add_policy(session, "p", "v1")
    assert add_policy(session, "p", "v2").version == "v2"
    assert queries.find_policy(session, "p", "v2") is not None
    assert [p.version for p in queries.list_policies(session)] == ["v2", "v1"]
