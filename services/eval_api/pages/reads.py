"""Read queries only the HTML pages need; everything else comes from ``services.store.queries``.

The pages reuse the store's ``leaderboard``, ``get_evaluation``, ``evaluation_results``,
``list_episodes``, ``get_policy`` and ``list_evaluations`` (and so the store's Wilson
intervals and aggregates). What is here is what no JSON route asks for: how many
policies each suite ranks (the suite tabs of the leaderboard page), and one column of
an evaluation's episodes (the latency histogram) without loading whole rows.
"""

from __future__ import annotations

from sqlalchemy import distinct, func, select
from sqlalchemy.orm import Session

from services.store.models import Episode, Evaluation, EvaluationStatus


def ranked_policy_counts(session: Session, *, include_nonstandard: bool = False) -> dict[str, int]:
    """Suite → number of policies the leaderboard ranks there (same filter as ``queries.leaderboard``)."""
    conditions = [Evaluation.status == EvaluationStatus.FINISHED, Evaluation.success_rate.is_not(None)]
    if not include_nonstandard:
        conditions.append(Evaluation.standard.is_(True))
    rows = session.execute(select(Evaluation.suite, func.count(distinct(Evaluation.policy_id)))
                           .where(*conditions).group_by(Evaluation.suite))
    return {suite: count for suite, count in rows}


def episode_latencies_ms(session: Session, evaluation_id: int) -> list[float]:
    """The mean policy latency of every episode of an evaluation that recorded one."""
    return list(session.scalars(select(Episode.latency_mean_ms).where(
        Episode.evaluation_id == evaluation_id, Episode.latency_mean_ms.is_not(None))))
