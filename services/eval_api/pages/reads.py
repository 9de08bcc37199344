"""Read queries only the HTML pages need; everything else comes from ``services.store.queries``.

The pages reuse the store's ``leaderboard``, ``ranked_policy_counts`` (both on the
store's one leaderboard-eligibility rule), ``get_evaluation``, ``evaluation_results``,
``list_episodes``, ``get_policy`` and ``list_evaluations`` (and so the store's Wilson
intervals and aggregates). What is here is what no JSON route asks for: one column
of an evaluation's episodes (the latency histogram) without loading whole rows.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.store.models import Episode


def episode_latencies_ms(session: Session, evaluation_id: int) -> list[float]:
    """The mean policy latency of every episode of an evaluation that recorded one."""
    return list(session.scalars(select(Episode.latency_mean_ms).where(
        Episode.evaluation_id == evaluation_id, Episode.latency_mean_ms.is_not(None))))
