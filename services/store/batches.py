"""The episode life cycle K episodes at a time, for a worker that gets a batch of ids per message (PostgreSQL).

The per-episode queries (``services.store.queries``: ``claim_episode``, ``extend_lease``,
``finish_episode``) cost a worker a few database round trips per episode; at a few
milliseconds of CPU each (statement, commit, WAL flush, ORM) that is most of what a short
episode costs (docs/benchmarks.md, "Control plane"). These are the same rules for a set of
episodes in one statement each:

- ``claim_episodes``: one ``UPDATE episodes … FROM evaluations, policies WHERE id = ANY(:ids)
  AND claimable … RETURNING`` the job's columns — the claims of K episodes and the read of what
  the worker needs to play them, one round trip. Claimable is what ``queries.claim_episode``
  says (``pending``, or ``running`` with an expired lease; attempts left; the evaluation
  running, or, with ``start_pending``, pending — then it is marked running first, in the same
  transaction, evaluation before episodes as the lock order in ``queries`` wants). The rows
  are locked in id order, so two workers racing on the same ids wait for each other instead of
  deadlocking; each row goes to exactly one of them.
- ``extend_leases``: the heartbeat of every episode a worker holds, one ``UPDATE … FROM
  unnest(ids, attempts)``; it answers which are still held and which of those belong to a
  cancelled evaluation.
- ``finish_episodes``: the results of many episodes in one ``UPDATE … FROM unnest(…)``. A row
  is written only while it is still ``running`` under this worker and this attempt
  (``status = 'running' AND worker_id = :me AND attempts = :attempt``), so each episode gets
  exactly one result: a late result (the lease expired and another worker took it), a
  duplicate, or one for an episode the sweeper closed is refused, row by row.

Plain SQL (Core ``text``), not the ORM: these run on every episode of the hot path, and the
arrays are bound as one parameter each, so the statement is the same whatever K. PostgreSQL
only; the embedded SQLite store keeps the per-episode path (one process, no contention to
amortise).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from services.store.models import EpisodeStatus, EvaluationStatus, FailureReason, utcnow

# What a worker needs to play an episode, in the order of services.workers.runner._Job's fields.
JOB_COLUMNS = ("e.evaluation_id, e.episode_index, v.suite, e.task, e.seed, e.max_steps, p.endpoint, e.attempts, "
               "p.checkpoint_sha256, v.cameras, p.protocol, p.observation_keys, p.action_dim, v.inference, v.record, "
               "v.episodes_per_task")

_START_PENDING = text("""
UPDATE evaluations SET status = 'running', started_at = :now
WHERE status = 'pending'
  AND id IN (SELECT evaluation_id FROM episodes WHERE id = ANY(CAST(:ids AS bigint[])) AND status = 'pending')
""")

_CLAIM = text(f"""
UPDATE episodes AS e
SET status = 'running', worker_id = :worker_id, attempts = e.attempts + 1, lease_expires_at = :lease_until,
    started_at = :now
FROM (SELECT id FROM episodes WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR UPDATE) AS locked,
     evaluations AS v, policies AS p
WHERE e.id = locked.id AND v.id = e.evaluation_id AND p.id = v.policy_id AND v.status = 'running'
  AND (e.status = 'pending' OR (e.status = 'running' AND e.lease_expires_at < :now))
  AND e.attempts < :max_attempts
RETURNING e.id, {JOB_COLUMNS}
""")

_EXTEND = text("""
UPDATE episodes AS e SET lease_expires_at = :lease_until
FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS integer[])) AS held(id, attempts), evaluations AS v
WHERE e.id = held.id AND e.attempts = held.attempts AND e.status = 'running' AND e.worker_id = :worker_id
  AND v.id = e.evaluation_id
RETURNING e.id, v.status
""")

_FINISH = text("""
UPDATE episodes AS e
SET status = r.status, success = r.success, total_return = r.total_return, steps = r.steps,
    duration_s = r.duration_s, latency_mean_ms = r.latency_mean_ms, latency_p95_ms = r.latency_p95_ms,
    failure_reason = r.failure_reason, error_message = r.error_message, artifact_path = r.artifact_path,
    recording_path = r.recording_path, simulator_versions = CAST(r.simulator_versions AS jsonb),
    initial_state_index = r.initial_state_index, worker_host = r.worker_host, renderer = r.renderer,
    finished_at = COALESCE(r.finished_at, :now), lease_expires_at = NULL
FROM unnest(CAST(:ids AS bigint[]), CAST(:attempts AS integer[]), CAST(:statuses AS varchar[]),
            CAST(:successes AS boolean[]), CAST(:total_returns AS double precision[]), CAST(:steps AS integer[]),
            CAST(:durations AS double precision[]), CAST(:latency_means AS double precision[]),
            CAST(:latency_p95s AS double precision[]), CAST(:failure_reasons AS varchar[]),
            CAST(:error_messages AS text[]), CAST(:artifact_paths AS varchar[]), CAST(:recording_paths AS varchar[]),
            CAST(:simulator_versions AS text[]), CAST(:initial_state_indexes AS integer[]),
            CAST(:worker_hosts AS varchar[]), CAST(:renderers AS varchar[]),
            CAST(:finished_ats AS timestamptz[]))
     AS r(id, attempts, status, success, total_return, steps, duration_s, latency_mean_ms, latency_p95_ms,
          failure_reason, error_message, artifact_path, recording_path, simulator_versions, initial_state_index,
          worker_host, renderer, finished_at)
WHERE e.id = r.id AND e.attempts = r.attempts AND e.status = 'running' AND e.worker_id = :worker_id
RETURNING e.id, e.attempts, e.evaluation_id
""")


def claim_episodes(session: Session, episode_ids: Sequence[int], worker_id: str, lease_s: float, *,
                   max_attempts: int, start_pending: bool = False, now: datetime | None = None) -> list[Any]:
    """Claim those of ``episode_ids`` that are claimable for ``worker_id`` for ``lease_s`` seconds, in one
    statement; the claimed rows (``id``, then ``JOB_COLUMNS``; ``attempts`` as claimed), in no order.

    An id that is not returned was left alone (finished, cancelled, running elsewhere, out of attempts,
    of an evaluation not running — or pending, unless ``start_pending``: then pending evaluations of
    pending episodes among the ids are marked running first, as an evaluation's first claim does).
    Commits when it claimed anything, else rolls back (so a start that claimed nothing is undone)."""
    if not episode_ids:
        return []
    now = now or utcnow()
    ids = sorted(set(episode_ids))
    if start_pending:
        session.execute(_START_PENDING, {"ids": ids, "now": now})
    rows = session.execute(_CLAIM, {"ids": ids, "worker_id": worker_id, "now": now,
                                    "lease_until": now + timedelta(seconds=lease_s),
                                    "max_attempts": max_attempts}).all()
    if rows:
        session.commit()
    else:
        session.rollback()
    return rows


@dataclass(frozen=True, slots=True)
class HeldLeases:
    """What ``extend_leases`` found: the episodes still held, and those of them whose evaluation was cancelled."""

    held: frozenset[int]
    cancelled: frozenset[int]


def extend_leases(session: Session, held: Sequence[tuple[int, int]], worker_id: str, lease_s: float, *,
                  now: datetime | None = None) -> HeldLeases:
    """Push the leases of every ``(episode id, attempt)`` in ``held`` that is still ``running`` under
    ``worker_id`` at that attempt to ``now + lease_s``, in one statement."""
    if not held:
        return HeldLeases(frozenset(), frozenset())
    now = now or utcnow()
    ordered = sorted(held)
    rows = session.execute(_EXTEND, {"ids": [i for i, _ in ordered], "attempts": [a for _, a in ordered],
                                     "worker_id": worker_id, "lease_until": now + timedelta(seconds=lease_s)}).all()
    session.commit()
    return HeldLeases(frozenset(r[0] for r in rows),
                      frozenset(r[0] for r in rows if r[1] == EvaluationStatus.CANCELLED.value))


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """One episode's result as ``finish_episodes`` writes it (the fields of ``queries.finish_episode``),
    for the attempt that played it. ``status`` is ``succeeded``, ``failed``, or ``cancelled`` (an
    episode of a cancelled evaluation that this worker held but never started)."""

    episode_id: int
    attempts: int
    status: str
    success: bool
    total_return: float | None = None
    steps: int | None = None
    duration_s: float | None = None
    latency_mean_ms: float | None = None
    latency_p95_ms: float | None = None
    failure_reason: str | None = None
    error_message: str | None = None
    artifact_path: str | None = None
    recording_path: str | None = None
    simulator_versions: dict[str, str] | None = None
    initial_state_index: int | None = None
    worker_host: str | None = None
    renderer: str | None = None
    finished_at: datetime | None = None  # when it ended (None: when written)

    def __post_init__(self) -> None:
        if self.status not in (EpisodeStatus.SUCCEEDED, EpisodeStatus.FAILED, EpisodeStatus.CANCELLED):
            raise ValueError(f"episode {self.episode_id}: a result's status is succeeded, failed or cancelled, "
                             f"not {self.status!r}")
        if self.failure_reason is not None:
            FailureReason(self.failure_reason)  # ValueError naming it if unknown
        if self.success != (self.status == EpisodeStatus.SUCCEEDED) or (self.success and self.failure_reason):
            raise ValueError(f"episode {self.episode_id}: status {self.status!r}, success {self.success} and "
                             f"failure reason {self.failure_reason!r} disagree")


def finish_episodes(session: Session, outcomes: Sequence[EpisodeOutcome], worker_id: str, *,
                    now: datetime | None = None) -> dict[tuple[int, int], int]:
    """Write ``outcomes`` in one statement, each only while its episode is still ``running`` under
    ``worker_id`` at its attempt; ``{(episode id, attempt): evaluation id}`` of the rows written (the
    others were refused: already closed, or no longer this worker's)."""
    if not outcomes:
        return {}
    now = now or utcnow()
    rows = sorted(outcomes, key=lambda o: (o.episode_id, o.attempts))
    written = session.execute(_FINISH, {
        "worker_id": worker_id, "now": now,
        "ids": [o.episode_id for o in rows], "attempts": [o.attempts for o in rows],
        "statuses": [o.status for o in rows], "successes": [o.success for o in rows],
        "total_returns": [o.total_return for o in rows], "steps": [o.steps for o in rows],
        "durations": [o.duration_s for o in rows], "latency_means": [o.latency_mean_ms for o in rows],
        "latency_p95s": [o.latency_p95_ms for o in rows], "failure_reasons": [o.failure_reason for o in rows],
        "error_messages": [o.error_message for o in rows], "artifact_paths": [o.artifact_path for o in rows],
        "recording_paths": [o.recording_path for o in rows],
        "simulator_versions": [json.dumps(o.simulator_versions) if o.simulator_versions else None for o in rows],
        "initial_state_indexes": [o.initial_state_index for o in rows],
        "worker_hosts": [o.worker_host for o in rows], "renderers": [o.renderer for o in rows],
        "finished_ats": [o.finished_at for o in rows],
    }).all()
    session.commit()
    return {(episode_id, attempts): evaluation_id for episode_id, attempts, evaluation_id in written}
