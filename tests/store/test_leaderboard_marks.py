"""The leaderboard's "not different from the one above" marks on each path (paired on shared (task,
seed) episodes, unpaired Newcombe when two policies ran different seeds), and its bounded number of
queries whatever the number of entries; on each store backend."""

from __future__ import annotations

import pytest
from sqlalchemy import event

from services.store import queries
from services.store.db import make_session_factory
from services.store.statistics import (
    mcnemar_exact,
    newcombe_paired_interval,
    newcombe_unpaired_interval,
)
from tests.store.helpers import add_evaluation, add_policy, run_all


@pytest.fixture
def session(store_engine):
    with make_session_factory(store_engine)() as session:
        yield session


def finished(session, policy, successes: int, *, per_task: int = 20, seed: int = 0) -> int:
    """A finished evaluation of 2 tasks × ``per_task`` episodes from ``seed``; the first ``successes`` of each
    task succeed."""
    created = add_evaluation(session, policy, per_task=per_task, seed=seed)
    won = {episode_id for t in range(2) for episode_id in
           created.episode_ids[t * per_task:t * per_task + successes]}
    run_all(session, created.episode_ids, successes=won)
    assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
    return created.evaluation.id


def test_policies_on_different_seeds_compare_unpaired_and_a_clear_gap_is_not_marked(session):
    top, low = add_policy(session, "top"), add_policy(session, "low")
    finished(session, top, 18)  # 36 of 40, seeds 1_000_000..
    finished(session, low, 6, seed=500)  # 12 of 40, seeds 1_000_500..: no (task, seed) in common
    first, second = queries.leaderboard(session, "metaworld-mt10")
    assert (first.policy.name, second.policy.name) == ("top", "low")
    versus = second.versus_above
    assert (versus.method, versus.pairs, versus.p_value) == ("unpaired", None, None)
    assert versus.difference == pytest.approx(12 / 40 - 36 / 40)
    assert (versus.ci_low, versus.ci_high) == pytest.approx(newcombe_unpaired_interval(12, 40, 36, 40))
    assert versus.ci_high < 0 and not second.not_different_from_above
    assert first.versus_above is None and not first.not_different_from_above


def test_a_small_unpaired_gap_is_marked_not_different(session):
    top, close = add_policy(session, "top"), add_policy(session, "close")
    finished(session, top, 11)  # 22 of 40
    finished(session, close, 9, seed=500)  # 18 of 40, other seeds
    _, second = queries.leaderboard(session, "metaworld-mt10")
    versus = second.versus_above
    assert versus.method == "unpaired" and versus.ci_low < 0 < versus.ci_high
    assert (versus.ci_low, versus.ci_high) == pytest.approx(newcombe_unpaired_interval(18, 40, 22, 40))
    assert second.not_different_from_above


def test_a_small_paired_gap_is_marked_not_different(session):
    top, close = add_policy(session, "top"), add_policy(session, "close")
    finished(session, top, 11)  # the first 11 seeds of each task succeed
    finished(session, close, 10)  # the same seeds, one fewer per task: 2 discordant pairs, both one way
    _, second = queries.leaderboard(session, "metaworld-mt10")
    versus = second.versus_above
    assert (versus.method, versus.pairs) == ("paired", 40)
    assert versus.p_value == pytest.approx(mcnemar_exact(2, 0))
    assert (versus.ci_low, versus.ci_high) == pytest.approx(newcombe_paired_interval(20, 2, 0, 18))
    assert versus.ci_low < 0 < versus.ci_high and second.not_different_from_above


def _statements(session, board) -> int:
    """How many statements ``board()`` sends to the database."""
    count = 0

    def counted(*_args):
        nonlocal count
        count += 1

    engine = session.get_bind()
    event.listen(engine, "before_cursor_execute", counted)
    try:
        board()
    finally:
        event.remove(engine, "before_cursor_execute", counted)
    return count


def test_the_leaderboard_sends_as_many_queries_for_many_entries_as_for_two(session):
    policies = [add_policy(session, f"p{i:02d}") for i in range(12)]
    for i, policy in enumerate(policies[:2]):
        finished(session, policy, 2 + i, per_task=4)

    def board():
        return queries.leaderboard(session, "metaworld-mt10")

    session.commit()
    few = _statements(session, board)
    for i, policy in enumerate(policies[2:]):
        finished(session, policy, i % 4, per_task=4, seed=100 * (i % 2))
    session.commit()
    many = _statements(session, board)
    assert len(board()) == 12
    assert many == few <= 5, f"{few} statements for 2 entries, {many} for 12: the pairing must be batched"
