"""Admission control of ``POST /evaluations``: a global cap on the episodes waiting to run.

One client submitting in a loop once piled 56,649 episode messages into the broker.
``EVALFORGE_MAX_QUEUED_EPISODES`` bounds the episodes that are ``pending`` in the
store (the source of truth — the broker only carries ids, and a broker that lost
messages still has those episodes waiting for the sweeper). A submission that would
take the count past the cap is a 429 naming the cap, the count and the fix. The
check and the insert are separate statements, so concurrent submissions can pass
the cap by at most one evaluation each: a bound on a pile-up, not an exact quota.
"""

from __future__ import annotations

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from services.eval_api.errors import ApiError
from services.store.models import UNMATERIALIZED_SQL, Episode, EpisodeStatus, Evaluation

QUEUE_FULL_RETRY_AFTER_S = 60


def queued_episodes(session: Session) -> int:
    """Episodes waiting for a worker, over every evaluation: the ``pending`` rows, and the episodes of
    large evaluations whose rows are not written yet (``episodes_unmaterialized``, read through its
    partial index), which will all be pending once they are."""
    pending = session.scalar(select(func.count()).select_from(Episode)
                             .where(Episode.status == EpisodeStatus.PENDING.value)) or 0
    unwritten = session.scalar(select(func.coalesce(func.sum(Evaluation.episodes_unmaterialized), 0))
                               .where(text(f"evaluations.{UNMATERIALIZED_SQL}"))) or 0
    return int(pending) + int(unwritten)


def check_queue_cap(session: Session, new_episodes: int, max_queued: int) -> None:
    """429 when ``new_episodes`` more would take the queued episodes past ``max_queued``."""
    queued = queued_episodes(session)
    if queued + new_episodes > max_queued:
        raise ApiError(
            429, "queue_full",
            f"{queued} episodes are already queued and this evaluation adds {new_episodes}, past the cap of "
            f"{max_queued} (EVALFORGE_MAX_QUEUED_EPISODES); retry when the workers have worked the queue down, "
            "or submit fewer episodes",
            {"queued_episodes": queued, "new_episodes": new_episodes, "max_queued_episodes": max_queued},
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})
