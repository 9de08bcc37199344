"""Queries on the store, shared by the API and the workers.

Each function takes a ``Session`` and, when it writes, commits its own transaction,
so a caller never holds locks across network calls.

The episode life cycle (the "Evaluation records" contract):

- ``create_evaluation`` writes the evaluation and all its episode rows (``pending``)
  in one transaction, the episodes with one INSERT statement — for up to
  ``INLINE_EPISODES`` episodes. A larger evaluation is written without episode rows:
  the evaluation row is the plan (``planned_episodes``), and ``materialize_episodes``
  writes its rows after the 202, ``MATERIALIZE_CHUNK`` per transaction in index order
  (``INSERT … ON CONFLICT DO NOTHING`` on ``(evaluation_id, episode_index)``), counting
  ``episodes_unmaterialized`` down; ``materialize_all`` hands each chunk's ids to the
  caller's publisher after its commit. The API runs it after the response; the sweeper
  finishes one an API process left unfinished (``unmaterialized_evaluations``). A chunk
  written after the evaluation was cancelled is written ``cancelled``, so every evaluation
  ends with ``episodes_total`` rows, one result each.
- ``claim_episode`` is a conditional UPDATE: ``pending``, or ``running`` with an
  expired lease → ``running`` with a new lease, attempt + 1. Exactly one of several
  concurrent claimers wins. ``claim_running_episode`` is the same claim for an evaluation
  already running, returning the columns the worker reads, in one statement (PostgreSQL).
  ``extend_lease`` is the running worker's heartbeat.
- ``finish_episode`` writes the result only while the episode is not terminal, so a
  redelivered task's second write is a no-op.
- ``finalize_evaluation_if_done`` looks (unlocked, on the partial index of live
  episodes) whether any episode is left — a live row, or one not materialised yet — and,
  only when none is, locks the evaluation row, checks again, stores the aggregates, and
  sets ``finished_at`` — once, however many workers call it at the same time.

The sweeper's queries (``stale_pending_episode_ids``, ``expired_episode_ids``,
``mark_lost_episodes``, ``close_cancelled_running_episodes``,
``unfinalised_evaluation_ids``) find what a lost message or a dead worker left
behind; the writes among them are conditional updates on episodes only.

Lock order, to stay deadlock-free on PostgreSQL: a transaction that locks both an
evaluation and its episodes locks the evaluation first (``claim_episode``,
``cancel_evaluation``, ``materialize_episodes``); the others lock only one of the two.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    String,
    and_,
    bindparam,
    delete,
    distinct,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.store.aggregates import EpisodeResult, is_scored, summarize, wilson_interval
from services.store.models import (
    LIVE_EPISODE_SQL,
    UNMATERIALIZED_SQL,
    Episode,
    EpisodeStatus,
    Evaluation,
    EvaluationStatus,
    EvaluationTag,
    FailureReason,
    Policy,
    PolicyEndpoint,
    RecordMode,
    UtcDateTime,
    Worker,
    utcnow,
)
from services.store.settings import settings as store_settings
from services.store.statistics import (
    mcnemar_exact,
    newcombe_paired_interval,
    newcombe_unpaired_interval,
)

log = logging.getLogger("evalforge.store.queries")

_LIVE = (EpisodeStatus.PENDING.value, EpisodeStatus.RUNNING.value)
_DONE_EVALUATION = (EvaluationStatus.FINISHED.value, EvaluationStatus.FAILED.value)


class StoreError(Exception):
    """Base of the errors queries raise for a caller to turn into a response."""


class NotFound(StoreError):
    """No row with that id."""


class Conflict(StoreError):
    """The request contradicts what is stored (duplicate name, finished evaluation, reused key)."""


class IdempotencyConflict(Conflict):
    """An idempotency key was already used with a different request."""

    def __init__(self, key: str, evaluation_id: int) -> None:
        super().__init__(f"Idempotency-Key {key!r} was already used for evaluation {evaluation_id} with a "
                         "different request body; send the original body to get that evaluation back, or use "
                         "a new key for a new evaluation")
        self.key = key
        self.evaluation_id = evaluation_id


class EvaluationAlreadyDone(Conflict):
    """Cancelling an evaluation that has already finished."""


class NotOwner(StoreError):
    """The row belongs to another API key (or to none, if made before keys were recorded)."""


# ---------------------------------------------------------------------------- policies


def create_policy(session: Session, *, name: str, version: str, endpoint: str, checkpoint_sha256: str | None,
                  state_dim: int | None, action_dim: int | None, chunk_size: int | None, tasks: Sequence[str],
                  cameras: Mapping[str, Sequence[int]] | None = None, protocol: str = "evalforge",
                  revision: str | None = None, observation_keys: Mapping[str, str] | None = None,
                  server_info: Mapping[str, Any] | None = None,
                  created_by_key_id: int | None = None) -> Policy:
    """Insert a policy, owned by API key ``created_by_key_id``; ``Conflict`` if ``(name, version)`` is taken.

    ``cameras``: ``{camera: (height, width)}`` its handshake asks for (none: a state-only policy).
    ``protocol`` is the one its server speaks; openpi and vla-eval servers may leave the sha256
    and the dimensions unsaid (None), and name their checkpoint by ``revision`` instead."""
    policy = Policy(name=name, version=version, endpoint=endpoint, protocol=protocol,
                    checkpoint_sha256=checkpoint_sha256, revision=revision, state_dim=state_dim,
                    action_dim=action_dim, chunk_size=chunk_size, tasks=list(tasks), cameras=camera_sizes(cameras),
                    observation_keys=dict(observation_keys) if observation_keys else None,
                    server_info=dict(server_info) if server_info else None, created_by_key_id=created_by_key_id,
                    replicas=[])  # loaded (empty), so a detached new policy still lists its endpoints
    session.add(policy)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise Conflict(f"a policy named {name!r} with version {version!r} is already registered") from exc
    return policy


def update_policy_endpoint(session: Session, policy: Policy, endpoint: str) -> Policy:
    """Point a registered policy at a new server address (same checkpoint, moved server)."""
    policy.endpoint = endpoint
    session.commit()
    return policy


def add_policy_endpoint(session: Session, policy: Policy, endpoint: str, *,
                        created_by_key_id: int | None = None) -> bool:
    """Add ``endpoint`` as a replica of ``policy`` (the caller checked its handshake); False when
    the policy already has it (its first endpoint or a replica), True when added."""
    if endpoint in policy.endpoints:
        session.rollback()
        return False
    session.add(PolicyEndpoint(policy_id=policy.id, endpoint=endpoint, created_by_key_id=created_by_key_id))
    try:
        session.commit()
    except IntegrityError:  # a concurrent request added the same one first
        session.rollback()
        session.refresh(policy)
        return False
    session.refresh(policy)
    return True


def remove_policy_endpoint(session: Session, policy: Policy, endpoint: str) -> bool:
    """Remove replica ``endpoint`` of ``policy``; False when it is not one (its first endpoint never is)."""
    removed = session.execute(delete(PolicyEndpoint).where(PolicyEndpoint.policy_id == policy.id,
                                                           PolicyEndpoint.endpoint == endpoint)).rowcount
    session.commit()
    session.refresh(policy)
    return bool(removed)


def policy_endpoints_of_evaluation(session: Session, evaluation_id: int) -> list[str]:
    """Every endpoint of the policy an evaluation runs: its first one, then its replicas in order."""
    first = session.scalar(select(Policy.endpoint).join(Evaluation, Evaluation.policy_id == Policy.id)
                           .where(Evaluation.id == evaluation_id))
    replicas = session.scalars(select(PolicyEndpoint.endpoint)
                               .join(Evaluation, Evaluation.policy_id == PolicyEndpoint.policy_id)
                               .where(Evaluation.id == evaluation_id).order_by(PolicyEndpoint.id)).all()
    session.rollback()
    if first is None:
        return []
    return [first, *(e for e in replicas if e != first)]


def get_policy(session: Session, policy_id: int) -> Policy | None:
    return session.get(Policy, policy_id)


def find_policy(session: Session, name: str, version: str) -> Policy | None:
    return session.scalar(select(Policy).where(Policy.name == name, Policy.version == version))


def list_policies(session: Session, *, before_id: int | None = None, limit: int = 50) -> list[Policy]:
    """Policies, newest first; ``before_id`` continues a previous page."""
    query = select(Policy).order_by(Policy.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(Policy.id < before_id)
    return list(session.scalars(query))


def camera_sizes(cameras: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """``{camera: [height, width]}`` as stored (JSON lists), in the given order; ``{}`` for none or NULL."""
    return {name: [int(size[0]), int(size[1])] for name, size in (cameras or {}).items()}


# ---------------------------------------------------------------------------- evaluations


@dataclass(frozen=True, slots=True)
class EpisodeSpec:
    """What one episode runs: the task, the simulator seed, and its step limit."""

    task: str
    seed: int
    max_steps: int


INLINE_EPISODES = store_settings.inline_episodes
"""Evaluations (``EVALFORGE_INLINE_EPISODES``, default 10,000) of up to this many episodes get all their rows in the transaction that creates them
(the path every evaluation took before migration 0013); larger ones get them after the 202. 10,000:
the API's default cap per evaluation (``EVALFORGE_MAX_EPISODES_PER_EVALUATION``), so a default
deployment never leaves that path, and 10,000 rows insert in ≈ 0.25 s on PostgreSQL (2.4 s per
100,000 measured, docs/benchmarks.md), which keeps even the largest inline 202 well under 1 s."""

MATERIALIZE_CHUNK = store_settings.materialize_chunk
"""Episode rows per transaction (``EVALFORGE_MATERIALIZE_CHUNK``, default 10,000) when a large evaluation is materialised after its 202: ≈ 0.25 s of
insert holding the evaluation's row lock, then its ids are enqueued (ten 1,000-message pipelines),
so workers start on the first chunk while the next is written."""


@dataclass(frozen=True, slots=True)
class CreatedEvaluation:
    evaluation: Evaluation
    episode_ids: list[int]
    created: bool  # False: an earlier request with the same idempotency key made it


def create_evaluation(session: Session, *, policy_id: int, suite: str, tasks: Sequence[str],
                      episodes_per_task: int, seed: int, max_steps: int | None, standard: bool,
                      tags: Sequence[str], episodes: Sequence[EpisodeSpec],
                      idempotency_key: str | None = None, request_sha256: str | None = None,
                      created_by_key_id: int | None = None,
                      cameras: Mapping[str, Sequence[int]] | None = None,
                      inference: Mapping[str, Any] | None = None, protocol: Mapping[str, Any] | None = None,
                      definition_hash: str | None = None, record: str = "none",
                      inline_episodes: int | None = None) -> CreatedEvaluation:
    """Insert an evaluation, owned by API key ``created_by_key_id``, and all its ``pending``
    episode rows in one transaction.

    More than ``inline_episodes`` (default ``INLINE_EPISODES``) episodes that follow the
    protocol's plan (``planned_episodes``: always so for what the API plans) are not written
    here: the evaluation is stored with ``episodes_unmaterialized = len(episodes)`` and no
    episode rows (``episode_ids`` is empty), and the caller runs ``materialize_all`` after
    answering. Without a protocol record, or with episodes the plan does not reproduce (a
    caller's own list), every row is written here, as for a small evaluation.

    With an ``idempotency_key`` the same API key already used for the same
    ``request_sha256``, returns that evaluation (``created=False``, no new rows); for
    another request, raises ``IdempotencyConflict``. Idempotency keys are per API key:
    another key's use of the same string is never seen. Two concurrent requests with
    one key resolve the same way, through the unique index on (API key, idempotency key).
    ``cameras`` (``{camera: (height, width)}``) are what its workers render for the policy;
    ``inference`` its inference settings (``action_horizon``, ``temporal_ensemble``);
    ``protocol`` the record of what produces its numbers (``provenance.build_protocol``) and
    ``definition_hash`` its suite's ``Suite.definition_hash()`` (its leaderboard version), both
    written in the same transaction as the episodes. ``record`` (``RecordMode``) names the episodes
    its workers record for a LeRobot dataset (``services/workers/recording.py``).
    """
    if not episodes:
        raise ValueError("an evaluation needs at least one episode")
    if idempotency_key is not None and created_by_key_id is None:
        # The unique index holds per API key, and NULL keys never collide in it: without a key
        # two racing submissions could both be created.
        raise ValueError("an idempotency key belongs to an API key: pass created_by_key_id with it")
    if idempotency_key is not None:
        existing = _replay(session, created_by_key_id, idempotency_key, request_sha256)
        if existing is not None:
            return existing
    now = utcnow()
    deferred = (len(episodes) > (INLINE_EPISODES if inline_episodes is None else inline_episodes)
                and _follows_plan(episodes, protocol, episodes_per_task))
    evaluation = Evaluation(
        policy_id=policy_id, suite=suite, tasks=list(tasks), episodes_per_task=episodes_per_task, seed=seed,
        max_steps=max_steps, standard=standard, status=EvaluationStatus.PENDING.value,
        idempotency_key=idempotency_key, request_sha256=request_sha256, episodes_total=len(episodes),
        created_by_key_id=created_by_key_id, cameras=camera_sizes(cameras),
        inference=dict(inference) if inference else null(),  # SQL NULL (not JSON null): the defaults
        protocol=dict(protocol) if protocol else null(), definition_hash=definition_hash, record=RecordMode(record).value, created_at=now,
        episodes_unmaterialized=len(episodes) if deferred else 0,
        tag_rows=[EvaluationTag(tag=tag) for tag in sorted(set(tags))])
    session.add(evaluation)
    try:
        session.flush()
        episode_ids = [] if deferred else _insert_episodes(session, evaluation.id, episodes, now)
        session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key is not None:
            existing = _replay(session, created_by_key_id, idempotency_key, request_sha256)
            if existing is not None:
                return existing
        raise
    return CreatedEvaluation(evaluation, episode_ids, created=True)


_EPISODE_COLUMNS = ("evaluation_id", "episode_index", "task", "seed", "max_steps", "status", "attempts",
                    "created_at")


def _insert_episodes(session: Session, evaluation_id: int, episodes: Sequence[EpisodeSpec],
                     now: datetime) -> list[int]:
    """Insert ``pending`` rows for ``episodes`` in one statement; their ids in episode order.

    PostgreSQL: ``INSERT … SELECT FROM unnest(arrays) RETURNING`` — four array
    parameters whatever the count, ~20 ms for 1,000 rows. (A multi-row VALUES list
    of 8,000 placeholders costs psycopg more to parse than the database to insert.)
    Elsewhere (SQLite): Core's multi-row INSERT … RETURNING.
    (``_insert_episode_chunk`` is the same insert for a chunk written after the 202.)
    """
    table = Episode.__table__
    if session.get_bind().dialect.name == "postgresql":
        rows = func.unnest(
            bindparam("indexes", type_=ARRAY(Integer)), bindparam("tasks", type_=ARRAY(String)),
            bindparam("seeds", type_=ARRAY(BigInteger)), bindparam("max_steps", type_=ARRAY(Integer)),
        ).table_valued("episode_index", "task", "seed", "max_steps").render_derived()
        source = select(literal(evaluation_id, BigInteger), rows.c.episode_index, rows.c.task, rows.c.seed,
                        rows.c.max_steps, literal(EpisodeStatus.PENDING.value), literal(0),
                        literal(now, UtcDateTime()))
        inserted = session.execute(
            insert(table).from_select(_EPISODE_COLUMNS, source).returning(table.c.id, table.c.episode_index),
            {"indexes": list(range(len(episodes))), "tasks": [e.task for e in episodes],
             "seeds": [e.seed for e in episodes], "max_steps": [e.max_steps for e in episodes]}).all()
        return [episode_id for episode_id, _ in sorted(inserted, key=lambda row: row[1])]
    values = [dict(zip(_EPISODE_COLUMNS, (evaluation_id, index, spec.task, spec.seed, spec.max_steps,
                                          EpisodeStatus.PENDING.value, 0, now), strict=True))
              for index, spec in enumerate(episodes)]
    return list(session.scalars(insert(table).returning(table.c.id, sort_by_parameter_order=True), values))


def planned_episodes(protocol: Mapping[str, Any] | None, episodes_per_task: int, start: int,
                     stop: int) -> list[EpisodeSpec]:
    """Episodes ``start`` … ``stop - 1`` of an evaluation, from what its row records: task-major
    (episode ``k`` runs task ``k // episodes_per_task`` of the protocol's ``tasks``, at that task's
    ``max_steps``) and, within a task, seeds counting up from the protocol's ``first_seed`` (the
    planner's ``evaluation_seed(seed + i)`` is ``first_seed + i``; ``create_evaluation`` defers an
    evaluation only after checking that the planner's episodes are exactly these).

    ``ValueError`` when the protocol lacks the tasks or the first seed (rows made before 0009)."""
    plan = _plan_of(protocol, episodes_per_task)
    if plan is None:
        raise ValueError("this evaluation's protocol record has no tasks, step limits or first seed to plan "
                         "its episodes from")
    limits, first_seed = plan
    if not 0 <= start <= stop <= len(limits) * episodes_per_task:
        raise ValueError(f"episodes {start}…{stop - 1} are outside the plan's {len(limits) * episodes_per_task}")
    return [EpisodeSpec(task=limits[k // episodes_per_task][0], seed=first_seed + k % episodes_per_task,
                        max_steps=limits[k // episodes_per_task][1]) for k in range(start, stop)]


def _plan_of(protocol: Mapping[str, Any] | None, episodes_per_task: int) -> tuple[list[tuple[str, int]], int] | None:
    """``([(task, max_steps)], first_seed)`` from a protocol record, or None when it has not got them."""
    try:
        limits = [(str(task["name"]), int(task["max_steps"])) for task in protocol["tasks"]]  # type: ignore[index]
        first_seed = int(protocol["seeds"]["first_seed"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return (limits, first_seed) if limits and episodes_per_task >= 1 else None


def _follows_plan(episodes: Sequence[EpisodeSpec], protocol: Mapping[str, Any] | None,
                  episodes_per_task: int) -> bool:
    """Whether ``planned_episodes`` reproduces ``episodes`` exactly (every task, seed and step limit):
    only then may their rows be written later from the evaluation row alone."""
    plan = _plan_of(protocol, episodes_per_task)
    if plan is None:
        return False
    limits, first_seed = plan
    if len(episodes) != len(limits) * episodes_per_task:
        return False
    for k, spec in enumerate(episodes):
        task, max_steps = limits[k // episodes_per_task]
        if spec.task != task or spec.seed != first_seed + k % episodes_per_task or spec.max_steps != max_steps:
            log.warning("episode %d (%s, seed %d) is not what the protocol plans (%s, seed %d): writing all %d "
                        "episode rows in the request's transaction", k, spec.task, spec.seed, task,
                        first_seed + k % episodes_per_task, len(episodes))
            return False
    return True


def _insert_episode_chunk(session: Session, evaluation_id: int, first_index: int, episodes: Sequence[EpisodeSpec],
                          now: datetime, *, cancelled: bool) -> list[int]:
    """Insert rows ``first_index …`` for ``episodes``, skipping any index that already has one (``ON
    CONFLICT (evaluation_id, episode_index) DO NOTHING``); the ids written, in episode order.

    ``cancelled``: the evaluation was cancelled before these rows existed, so they are written
    as cancel would have left them (``cancelled``, ``failure_reason`` cancelled, finished now)."""
    table = Episode.__table__
    columns: tuple[str, ...] = _EPISODE_COLUMNS
    status = (EpisodeStatus.CANCELLED if cancelled else EpisodeStatus.PENDING).value
    extra: tuple[Any, ...] = ()
    if cancelled:
        columns = (*columns, "success", "failure_reason", "finished_at")
        extra = (False, FailureReason.CANCELLED.value, now)
    key = ["evaluation_id", "episode_index"]
    stop = first_index + len(episodes)
    if session.get_bind().dialect.name == "postgresql":
        rows = func.unnest(
            bindparam("indexes", type_=ARRAY(Integer)), bindparam("tasks", type_=ARRAY(String)),
            bindparam("seeds", type_=ARRAY(BigInteger)), bindparam("max_steps", type_=ARRAY(Integer)),
        ).table_valued("episode_index", "task", "seed", "max_steps").render_derived()
        literals = [literal(False), literal(FailureReason.CANCELLED.value), literal(now, UtcDateTime())] \
            if cancelled else []
        source = select(literal(evaluation_id, BigInteger), rows.c.episode_index, rows.c.task, rows.c.seed,
                        rows.c.max_steps, literal(status), literal(0), literal(now, UtcDateTime()), *literals)
        inserted = session.execute(
            postgresql_insert(table).from_select(columns, source).on_conflict_do_nothing(index_elements=key)
            .returning(table.c.id, table.c.episode_index),
            {"indexes": list(range(first_index, stop)), "tasks": [e.task for e in episodes],
             "seeds": [e.seed for e in episodes], "max_steps": [e.max_steps for e in episodes]}).all()
        return [episode_id for episode_id, _ in sorted(inserted, key=lambda row: row[1])]
    values = [dict(zip(columns, (evaluation_id, first_index + k, spec.task, spec.seed, spec.max_steps, status, 0,
                                 now, *extra), strict=True))
              for k, spec in enumerate(episodes)]
    session.execute(sqlite_insert(table).on_conflict_do_nothing(index_elements=key), values)
    return list(session.scalars(select(Episode.id).where(Episode.evaluation_id == evaluation_id,
                                                         Episode.episode_index >= first_index,
                                                         Episode.episode_index < stop, Episode.created_at == now)
                                .order_by(Episode.episode_index)))


def materialize_episodes(session: Session, evaluation_id: int, *, chunk: int | None = None) -> list[int] | None:
    """Write the next ``chunk`` (default ``MATERIALIZE_CHUNK``) of a deferred evaluation's episode
    rows, in one transaction; the ids of the ``pending`` rows written (to enqueue, after this
    commit), ``[]`` when there were none to enqueue, None when no row is left to write.

    Locks the evaluation row first (the lock order above), writes the rows after the last one that
    exists from the plan (``planned_episodes``) with ``ON CONFLICT DO NOTHING``, and counts
    ``episodes_unmaterialized`` down in the same transaction — a conditional update, so of two
    materialisers (the API's and the sweeper's) each chunk is written by one. A chunk written after
    the evaluation was cancelled is written ``cancelled`` (nothing to enqueue), as cancelling would
    have left it had it existed."""
    chunk = MATERIALIZE_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    row = session.execute(select(Evaluation.status, Evaluation.episodes_total, Evaluation.episodes_unmaterialized,
                                 Evaluation.episodes_per_task, Evaluation.protocol)
                          .where(Evaluation.id == evaluation_id).with_for_update()).first()
    if row is None or row.episodes_unmaterialized <= 0:
        session.rollback()
        return None
    start = row.episodes_total - row.episodes_unmaterialized
    stop = min(start + chunk, row.episodes_total)
    try:
        specs = planned_episodes(row.protocol, row.episodes_per_task, start, stop)
    except ValueError:
        session.rollback()
        raise
    cancelled = row.status == EvaluationStatus.CANCELLED
    episode_ids = _insert_episode_chunk(session, evaluation_id, start, specs, utcnow(), cancelled=cancelled)
    advanced = session.execute(
        update(Evaluation).where(Evaluation.id == evaluation_id,
                                 Evaluation.episodes_unmaterialized == row.episodes_unmaterialized)
        .values(episodes_unmaterialized=row.episodes_total - stop)
        .returning(Evaluation.id).execution_options(synchronize_session=False)).first()
    if advanced is None:  # another materialiser wrote this chunk first: nothing of ours to keep
        session.rollback()
        return []
    session.commit()
    return [] if cancelled else episode_ids


def materialize_all(session: Session, evaluation_id: int, publish: Callable[[list[int]], object], *,
                    chunk: int | None = None) -> int:
    """Write every episode row a deferred evaluation still lacks, chunk by chunk
    (``materialize_episodes``), handing each chunk's pending ids to ``publish`` (the episode queue)
    after its commit — no transaction is open while it publishes. Then finalises the evaluation if
    nothing is left to run (a cancelled one whose last rows were written cancelled). Returns the
    number of episode ids published; 0 for an evaluation with nothing left to write."""
    published = 0
    while (episode_ids := materialize_episodes(session, evaluation_id, chunk=chunk)) is not None:
        if episode_ids:
            publish(episode_ids)
            published += len(episode_ids)
    finalize_evaluation_if_done(session, evaluation_id)
    return published


def unmaterialized_evaluations(session: Session, *, created_before: datetime, limit: int = 100
                               ) -> list[tuple[int, str]]:
    """``(id, suite)`` of evaluations created before ``created_before`` whose episode rows are not all
    written yet (the API process that answered their 202 may have died): the sweeper finishes them.
    Reads the partial index ``ix_evaluations_unmaterialized`` only."""
    rows = session.execute(select(Evaluation.id, Evaluation.suite)
                           .where(text(f"evaluations.{UNMATERIALIZED_SQL}"), Evaluation.created_at < created_before)
                           .order_by(Evaluation.id).limit(limit)).all()
    session.rollback()
    return [(evaluation_id, suite) for evaluation_id, suite in rows]


def _replay(session: Session, key_id: int | None, key: str, request_sha256: str | None) -> CreatedEvaluation | None:
    owner = Evaluation.created_by_key_id.is_(None) if key_id is None else Evaluation.created_by_key_id == key_id
    existing = session.scalar(select(Evaluation).where(owner, Evaluation.idempotency_key == key))
    if existing is None:
        return None
    if existing.request_sha256 != request_sha256:
        raise IdempotencyConflict(key, existing.id)
    return CreatedEvaluation(existing, [], created=False)


def get_evaluation(session: Session, evaluation_id: int) -> Evaluation | None:
    return session.get(Evaluation, evaluation_id)


def list_evaluations(session: Session, *, policy_id: int | None = None, suite: str | None = None,
                     status: str | None = None, tag: str | None = None, before_id: int | None = None,
                     limit: int = 50) -> list[Evaluation]:
    """Evaluations matching every given filter, newest first; ``before_id`` continues a page."""
    query = select(Evaluation).order_by(Evaluation.id.desc()).limit(limit)
    if policy_id is not None:
        query = query.where(Evaluation.policy_id == policy_id)
    if suite is not None:
        query = query.where(Evaluation.suite == suite)
    if status is not None:
        query = query.where(Evaluation.status == status)
    if tag is not None:
        query = query.where(Evaluation.id.in_(select(EvaluationTag.evaluation_id).where(EvaluationTag.tag == tag)))
    if before_id is not None:
        query = query.where(Evaluation.id < before_id)
    return list(session.scalars(query))


def _episode_results(session: Session, evaluation_id: int, *, below_index: int | None = None) -> list[EpisodeResult]:
    query = (select(Episode.task, Episode.status, Episode.success, Episode.steps, Episode.latency_mean_ms,
                    Episode.latency_p95_ms, Episode.failure_reason)
             .where(Episode.evaluation_id == evaluation_id))
    if below_index is not None:
        query = query.where(Episode.episode_index < below_index)
    return [EpisodeResult(*row) for row in session.execute(query)]


def evaluation_results(session: Session, evaluation: Evaluation) -> dict[str, Any]:
    """Counts by episode status, per-task and overall results: stored once final, else computed live.

    The episodes of a deferred evaluation that have no row yet count as ``pending`` (in ``counts``,
    ``overall`` and their task's ``episodes``), so the counts always add up to ``episodes_total``:
    the count still to write is read first, and only the rows before it (which all existed then)."""
    if evaluation.aggregates is not None:
        return evaluation.aggregates
    missing = 0
    if evaluation.episodes_unmaterialized:  # once 0 it stays 0: no need to read it again
        missing = session.scalar(select(Evaluation.episodes_unmaterialized)
                                 .where(Evaluation.id == evaluation.id)) or 0
    start = evaluation.episodes_total - missing
    results = summarize(_episode_results(session, evaluation.id, below_index=start if missing else None),
                        evaluation.tasks)
    if missing:
        per_task = evaluation.episodes_per_task
        results["counts"][EpisodeStatus.PENDING.value] += missing
        results["overall"]["episodes"] += missing
        for j, entry in enumerate(results["per_task"][:len(evaluation.tasks)]):  # task_order's entries first
            entry["episodes"] += max(0, (j + 1) * per_task - max(start, j * per_task))
    return results


def list_episodes(session: Session, evaluation_id: int, *, after_index: int | None = None,
                  status: str | None = None, limit: int = 100) -> list[Episode]:
    """An evaluation's episodes in index order; ``after_index`` continues a page."""
    query = (select(Episode).where(Episode.evaluation_id == evaluation_id)
             .order_by(Episode.episode_index).limit(limit))
    if after_index is not None:
        query = query.where(Episode.episode_index > after_index)
    if status is not None:
        query = query.where(Episode.status == status)
    return list(session.scalars(query))


def recorded_episodes(session: Session, evaluation_id: int) -> list[Episode]:
    """An evaluation's episodes that have a rollout recording (``recording_path``), in index order."""
    return list(session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id,
                                                      Episode.recording_path.is_not(None))
                                .order_by(Episode.episode_index)))


def iter_episodes(session: Session, evaluation_id: int, *, status: str | None = None,
                  batch: int = 1000) -> Iterator[list[Row[Any]]]:
    """Every episode of an evaluation (optionally only those with ``status``), in index order,
    ``batch`` rows at a time: what an export streams, never holding them all.

    Keyset pagination on ``(evaluation_id, episode_index)`` (the unique index), so each batch
    costs the same at any depth. Rows are plain column rows (every column of ``episodes``), not
    ORM objects, and each batch's read transaction ends before it is yielded: a slow reader of
    a million episodes holds no connection while it reads.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    query = (select(*Episode.__table__.columns).where(Episode.evaluation_id == evaluation_id)
             .order_by(Episode.episode_index).limit(batch))
    if status is not None:
        query = query.where(Episode.status == status)
    after_index = -1
    while True:
        rows = list(session.execute(query.where(Episode.episode_index > after_index)))
        session.rollback()
        if not rows:
            return
        yield rows
        if len(rows) < batch:
            return
        after_index = rows[-1].episode_index


def cancel_evaluation(session: Session, evaluation_id: int, *, by_key_id: int | None = None) -> Evaluation:
    """Cancel: pending episodes → ``cancelled``; running ones finish and are kept.

    Cancelling a cancelled evaluation returns it unchanged; a finished or failed one
    raises ``EvaluationAlreadyDone``. The evaluation is finalised (status stays
    ``cancelled``) once its last running episode ends — at once if none is running.
    With ``by_key_id``, only the API key that submitted the evaluation may cancel it
    (``NotOwner`` otherwise); without, anyone (admins, the operator's tools).
    """
    row = session.execute(select(Evaluation.status, Evaluation.created_by_key_id)
                          .where(Evaluation.id == evaluation_id).with_for_update()).first()
    if row is None:
        session.rollback()
        raise NotFound(f"no evaluation with id {evaluation_id}")
    if by_key_id is not None and row.created_by_key_id != by_key_id:
        session.rollback()
        raise NotOwner(f"evaluation {evaluation_id} was submitted by another API key; only that key or an "
                       "admin key can cancel it")
    if row.status in _DONE_EVALUATION:
        session.rollback()
        raise EvaluationAlreadyDone(f"evaluation {evaluation_id} is already {row.status}; only pending or "
                                    "running evaluations can be cancelled")
    if row.status != EvaluationStatus.CANCELLED:
        now = utcnow()
        session.execute(update(Evaluation).where(Evaluation.id == evaluation_id)
                        .values(status=EvaluationStatus.CANCELLED.value, cancelled_at=now)
                        .execution_options(synchronize_session=False))
        session.execute(update(Episode)
                        .where(Episode.evaluation_id == evaluation_id, Episode.status == EpisodeStatus.PENDING)
                        .values(status=EpisodeStatus.CANCELLED.value, success=False,
                                failure_reason=FailureReason.CANCELLED.value, finished_at=now)
                        .execution_options(synchronize_session=False))
        session.commit()
        finalize_evaluation_if_done(session, evaluation_id)
    session.expire_all()
    evaluation = session.get(Evaluation, evaluation_id)
    assert evaluation is not None
    return evaluation


# ---------------------------------------------------------------------------- episode life cycle


def claim_episode(session: Session, episode_id: int, worker_id: str, lease_s: float, *,
                  max_attempts: int | None = None, now: datetime | None = None) -> bool:
    """Take episode ``episode_id`` for ``worker_id`` for ``lease_s`` seconds; True when claimed.

    Claimable: ``pending``, or ``running`` whose lease has expired (its worker is
    presumed dead), in an evaluation that is not cancelled, with fewer than
    ``max_attempts`` attempts so far (if given). The first claim of an evaluation
    marks it ``running``. Lease times use this process's clock: keep hosts in NTP sync.
    """
    now = now or utcnow()
    found = session.execute(
        select(Episode.evaluation_id, Evaluation.status)
        .join(Evaluation, Evaluation.id == Episode.evaluation_id).where(Episode.id == episode_id)).first()
    if found is None or found.status not in (EvaluationStatus.PENDING, EvaluationStatus.RUNNING):
        session.rollback()
        return False
    if found.status == EvaluationStatus.PENDING:
        # Evaluation first (see the lock order above); a no-op once another claim got here.
        session.execute(update(Evaluation)
                        .where(Evaluation.id == found.evaluation_id, Evaluation.status == EvaluationStatus.PENDING)
                        .values(status=EvaluationStatus.RUNNING.value, started_at=now)
                        .execution_options(synchronize_session=False))
    conditions = [Episode.id == episode_id,
                  or_(Episode.status == EpisodeStatus.PENDING,
                      and_(Episode.status == EpisodeStatus.RUNNING, Episode.lease_expires_at < now))]
    if max_attempts is not None:
        conditions.append(Episode.attempts < max_attempts)
    claimed = session.execute(
        update(Episode).where(*conditions)
        .values(status=EpisodeStatus.RUNNING.value, worker_id=worker_id, attempts=Episode.attempts + 1,
                lease_expires_at=now + timedelta(seconds=lease_s), started_at=now)
        .returning(Episode.id).execution_options(synchronize_session=False)).first()
    if claimed is None:
        session.rollback()  # also undoes marking the evaluation running
        return False
    session.commit()
    return True


def claim_running_episode(session: Session, episode_id: int, worker_id: str, lease_s: float,
                          returning: Sequence[ColumnElement[Any]], *, max_attempts: int | None = None,
                          now: datetime | None = None) -> Row | None:
    """``claim_episode`` and the read of what the worker needs, in one statement, for an episode of an
    evaluation that is already ``running`` (every claim but an evaluation's first): the row of
    ``returning`` (columns of the episode, as claimed, of its evaluation and of its policy), or
    None — then nothing was changed, and ``claim_episode`` says whether it can be claimed at all.

    The same conditions as ``claim_episode`` (claimable episode, attempts left, an evaluation
    neither pending, cancelled nor done) in one conditional ``UPDATE … FROM evaluations, policies
    … RETURNING``. The evaluation row is read, not locked, as ``claim_episode`` reads it for a
    running evaluation. PostgreSQL only (SQLite's RETURNING cannot name the other tables): None at
    once on any other backend."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    now = now or utcnow()
    conditions = [Episode.id == episode_id, Evaluation.id == Episode.evaluation_id,
                  Evaluation.status == EvaluationStatus.RUNNING, Policy.id == Evaluation.policy_id,
                  or_(Episode.status == EpisodeStatus.PENDING,
                      and_(Episode.status == EpisodeStatus.RUNNING, Episode.lease_expires_at < now))]
    if max_attempts is not None:
        conditions.append(Episode.attempts < max_attempts)
    row = session.execute(
        update(Episode).where(*conditions)
        .values(status=EpisodeStatus.RUNNING.value, worker_id=worker_id, attempts=Episode.attempts + 1,
                lease_expires_at=now + timedelta(seconds=lease_s), started_at=now)
        .returning(*returning).execution_options(synchronize_session=False)).first()
    if row is None:
        session.rollback()
        return None
    session.commit()
    return row


def extend_lease(session: Session, episode_id: int, worker_id: str, lease_s: float, *,
                 now: datetime | None = None) -> bool:
    """Heartbeat: push the lease of a running episode ``worker_id`` holds to ``now + lease_s``.

    False when the episode is no longer this worker's (its lease expired and another
    worker claimed it, or it finished): the caller should stop working on it.
    """
    now = now or utcnow()
    extended = session.execute(
        update(Episode).where(Episode.id == episode_id, Episode.status == EpisodeStatus.RUNNING,
                              Episode.worker_id == worker_id)
        .values(lease_expires_at=now + timedelta(seconds=lease_s))
        .returning(Episode.id).execution_options(synchronize_session=False)).first()
    session.commit()
    return extended is not None


def finish_episode(session: Session, episode_id: int, *, success: bool, total_return: float | None = None,
                   steps: int | None = None, duration_s: float | None = None,
                   latency_mean_ms: float | None = None, latency_p95_ms: float | None = None,
                   failure_reason: FailureReason | str | None = None, error_message: str | None = None,
                   artifact_path: str | None = None, simulator_versions: Mapping[str, str] | None = None,
                   initial_state_index: int | None = None, worker_host: str | None = None,
                   renderer: str | None = None, recording_path: str | None = None,
                   now: datetime | None = None) -> bool:
    """Record an episode's result once; True when written, False when it was already terminal.

    ``success=False`` without a ``failure_reason`` means the episode ran out of steps.
    ``artifact_path``: its replay GIF, relative to the workers' ``ARTIFACT_ROOT``;
    ``simulator_versions``: ``{package: version}`` of the simulator it ran on;
    ``initial_state_index``: the fixed initial state its seed picked, for suites that have them;
    ``worker_host``: the host name of the worker that played it; ``renderer``: what rendered its
    frames (``MUJOCO_GL``'s backend for MuJoCo simulators); ``recording_path``: its rollout recording
    (``services/workers/recording.py``), relative to ``ARTIFACT_ROOT``.
    """
    reason = FailureReason(failure_reason).value if failure_reason is not None else None
    if success and reason is not None:
        raise ValueError(f"episode {episode_id}: a successful episode cannot have failure reason {reason!r}")
    now = now or utcnow()
    written = session.execute(
        update(Episode).where(Episode.id == episode_id, Episode.status.in_(_LIVE))
        .values(status=(EpisodeStatus.SUCCEEDED if success else EpisodeStatus.FAILED).value, success=success,
                total_return=total_return, steps=steps, duration_s=duration_s, latency_mean_ms=latency_mean_ms,
                latency_p95_ms=latency_p95_ms, failure_reason=reason, error_message=error_message,
                artifact_path=artifact_path, recording_path=recording_path, finished_at=now, lease_expires_at=None,
                simulator_versions=dict(simulator_versions) if simulator_versions else null(),
                initial_state_index=initial_state_index, worker_host=worker_host, renderer=renderer)
        .returning(Episode.id).execution_options(synchronize_session=False)).first()
    session.commit()
    return written is not None


def _episodes_left(session: Session, evaluation_id: int) -> bool:
    """Whether any episode of the evaluation is still to run: a row pending or running (one probe of
    the partial index ``ix_episodes_live_evaluation_id``, whatever the evaluation's size), or one not
    written yet (``episodes_unmaterialized``, by primary key) — in one statement."""
    live = select(Episode.id).where(Episode.evaluation_id == evaluation_id, text(LIVE_EPISODE_SQL)).exists()
    unwritten = select(Evaluation.id).where(Evaluation.id == evaluation_id,
                                            Evaluation.episodes_unmaterialized > 0).exists()
    return bool(session.scalar(select(or_(live, unwritten))))


def finalize_evaluation_if_done(session: Session, evaluation_id: int) -> bool:
    """If every episode of the evaluation is terminal, store its results and close it; True
    only for the one call that did (every other concurrent or later call gets False).

    Call it after the transaction that ended an episode has committed: it first looks, without a
    lock, whether any episode is left, and returns False at once if so (most results). That is
    safe because of that order: of two episodes ending at the same time, the one whose commit is
    later sees the other's in its look (each statement sees what was committed before it began),
    so the last one to end always goes on to the locked check below.

    A deferred evaluation is never finalised while any of its rows is unwritten: the look and the
    locked check both count those as left, and the materialiser writes its last chunk under the
    same row lock, so a check that waited on it sees the new pending rows."""
    if _episodes_left(session, evaluation_id):
        session.rollback()
        return False
    row = session.execute(select(Evaluation.status, Evaluation.tasks, Evaluation.finished_at)
                          .where(Evaluation.id == evaluation_id).with_for_update()).first()
    if row is None or row.finished_at is not None:
        session.rollback()
        return False
    if _episodes_left(session, evaluation_id):
        session.rollback()
        return False
    results = summarize(_episode_results(session, evaluation_id), row.tasks)
    overall = results["overall"]
    if row.status == EvaluationStatus.CANCELLED:
        status = EvaluationStatus.CANCELLED
    else:
        status = EvaluationStatus.FINISHED if overall["scored"] else EvaluationStatus.FAILED
    interval = overall["ci95"] or {}
    done = session.execute(
        update(Evaluation).where(Evaluation.id == evaluation_id, Evaluation.finished_at.is_(None))
        .values(status=status.value, finished_at=utcnow(), episodes_scored=overall["scored"],
                episodes_succeeded=overall["succeeded"], success_rate=overall["success_rate"],
                success_ci_low=interval.get("low"), success_ci_high=interval.get("high"), aggregates=results)
        .returning(Evaluation.id).execution_options(synchronize_session=False)).first()
    session.commit()
    return done is not None


# ---------------------------------------------------------------------------- sweeper


def stale_pending_episode_ids(session: Session, *, created_before: datetime, limit: int = 1000) -> list[int]:
    """Episodes still ``pending`` that were created before ``created_before`` (their broker
    message may be lost), of evaluations still open; oldest first."""
    ids = list(session.scalars(
        select(Episode.id).join(Evaluation, Evaluation.id == Episode.evaluation_id)
        .where(Episode.status == EpisodeStatus.PENDING, Episode.created_at < created_before,
               Evaluation.status.in_((EvaluationStatus.PENDING.value, EvaluationStatus.RUNNING.value)))
        .order_by(Episode.id).limit(limit)))
    session.rollback()
    return ids


def episode_suites(session: Session, episode_ids: Sequence[int]) -> dict[int, str]:
    """``{episode id: its evaluation's suite}`` for the ids that exist (what the sweeper routes by)."""
    if not episode_ids:
        return {}
    rows = session.execute(select(Episode.id, Evaluation.suite).join(Evaluation, Evaluation.id == Episode.evaluation_id)
                           .where(Episode.id.in_(list(episode_ids))))
    return {episode_id: suite for episode_id, suite in rows}


def expired_episode_ids(session: Session, *, max_attempts: int, now: datetime | None = None,
                        limit: int = 1000) -> list[int]:
    """``running`` episodes whose lease expired, with attempts left, of open evaluations: to run again."""
    now = now or utcnow()
    ids = list(session.scalars(
        select(Episode.id).join(Evaluation, Evaluation.id == Episode.evaluation_id)
        .where(Episode.status == EpisodeStatus.RUNNING, Episode.lease_expires_at < now,
               Episode.attempts < max_attempts,
               Evaluation.status.in_((EvaluationStatus.PENDING.value, EvaluationStatus.RUNNING.value)))
        .order_by(Episode.id).limit(limit)))
    session.rollback()
    return ids


def mark_lost_episodes(session: Session, *, max_attempts: int, now: datetime | None = None,
                       episode_id: int | None = None) -> list[int]:
    """``running`` episodes with an expired lease and no attempts left → ``failed``/``worker_lost``.

    Returns the ids of the evaluations touched (for the caller to finalise). A
    conditional update, so a concurrent sweeper or worker cannot double-write.
    """
    now = now or utcnow()
    conditions = [Episode.status == EpisodeStatus.RUNNING, Episode.lease_expires_at < now,
                  Episode.attempts >= max_attempts]
    if episode_id is not None:
        conditions.append(Episode.id == episode_id)
    rows = session.execute(
        update(Episode).where(*conditions)
        .values(status=EpisodeStatus.FAILED.value, success=False, failure_reason=FailureReason.WORKER_LOST.value,
                error_message=f"the worker was lost {max_attempts} times (lease expired); giving up",
                finished_at=now, lease_expires_at=None)
        .returning(Episode.evaluation_id).execution_options(synchronize_session=False)).all()
    session.commit()
    return sorted({row[0] for row in rows})


def close_cancelled_running_episodes(session: Session, *, now: datetime | None = None) -> list[int]:
    """``running`` episodes of cancelled evaluations whose lease expired (their worker died, and
    no worker may claim them again) → ``cancelled``; returns the evaluation ids touched."""
    now = now or utcnow()
    cancelled = select(Evaluation.id).where(Evaluation.status == EvaluationStatus.CANCELLED)
    rows = session.execute(
        update(Episode).where(Episode.status == EpisodeStatus.RUNNING, Episode.lease_expires_at < now,
                              Episode.evaluation_id.in_(cancelled))
        .values(status=EpisodeStatus.CANCELLED.value, success=False, failure_reason=FailureReason.CANCELLED.value,
                finished_at=now, lease_expires_at=None)
        .returning(Episode.evaluation_id).execution_options(synchronize_session=False)).all()
    session.commit()
    return sorted({row[0] for row in rows})


def unfinalised_evaluation_ids(session: Session, *, limit: int = 1000) -> list[int]:
    """Evaluations not yet finalised, with every episode row written, none of whose episodes is live
    (e.g. a worker died between finishing the last episode and finalising): the sweeper finalises them."""
    live = select(Episode.id).where(Episode.evaluation_id == Evaluation.id, Episode.status.in_(_LIVE))
    ids = list(session.scalars(select(Evaluation.id).where(Evaluation.finished_at.is_(None),
                                                           Evaluation.episodes_unmaterialized == 0, ~live.exists())
                               .order_by(Evaluation.id).limit(limit)))
    session.rollback()
    return ids


# ---------------------------------------------------------------------------- leaderboard


def leaderboard_eligibility(*, include_nonstandard: bool = False) -> list[ColumnElement[bool]]:
    """The conditions an evaluation meets to be ranked on its suite's leaderboard, the one rule every
    ranking reads (``leaderboard``, ``ranked_policy_counts``): finished with a success rate, and
    ``standard`` (every task, standard step limits) unless ``include_nonstandard``; and not mostly
    harness failures (``aggregates.unranked_reason``: scored episodes at least half of them all)."""
    conditions = [Evaluation.status == EvaluationStatus.FINISHED, Evaluation.success_rate.is_not(None),
                  Evaluation.episodes_scored * 2 >= Evaluation.episodes_total]
    if not include_nonstandard:
        conditions.append(Evaluation.standard.is_(True))
    return conditions


def ranked_policy_counts(session: Session, *, include_nonstandard: bool = False,
                         current_definitions: Mapping[str, str] | None = None) -> dict[str, int]:
    """Suite → number of policies its leaderboard ranks (the suite tabs of the leaderboard page).

    With ``current_definitions`` (suite → its current definition hash), only evaluations of
    that definition count, as the leaderboard ranks only those."""
    rows = session.execute(select(Evaluation.suite, Evaluation.definition_hash,
                                  func.count(distinct(Evaluation.policy_id)))
                           .where(*leaderboard_eligibility(include_nonstandard=include_nonstandard))
                           .group_by(Evaluation.suite, Evaluation.definition_hash))
    counts: dict[str, int] = {}
    for suite, definition_hash, count in rows:
        if current_definitions is None or current_definitions.get(suite) == definition_hash:
            counts[suite] = counts.get(suite, 0) + count
    return counts


@dataclass(frozen=True, slots=True)
class NeighbourDifference:
    """An entry's success rate less the one ranked above it, with its 95% interval.

    ``method``: ``paired`` (Newcombe's method 10 for paired data on the (task, seed) pairs both
    pools scored, and the exact McNemar ``p_value``) when the two share such pairs, else
    ``unpaired`` (Newcombe's method 10 for independent samples on the whole pools; no p-value).
    ``pairs``: the pairs compared (paired), or None."""

    difference: float
    ci_low: float
    ci_high: float
    method: str
    pairs: int | None = None
    p_value: float | None = None

    @property
    def significant(self) -> bool:
        """Whether the 95% interval of the difference excludes 0."""
        return self.ci_high < 0 or self.ci_low > 0


@dataclass(frozen=True, slots=True)
class LeaderboardEntry:
    """One policy (under one set of inference settings) on a suite's board: its comparable evaluations pooled.

    ``evaluation_ids``: the evaluations whose scored episodes were pooled, oldest first;
    ``episodes``/``successes``: the pooled counts; ``ci_low``/``ci_high``: their Wilson 95%
    interval. ``versus_above``: the difference from the entry ranked above (None for the first)."""

    rank: int
    policy: Policy
    evaluation_ids: list[int]
    success_rate: float
    ci_low: float
    ci_high: float
    episodes: int
    successes: int
    finished_at: datetime  # when its latest contributing evaluation finished
    inference: dict[str, Any] | None = None
    versus_above: NeighbourDifference | None = None

    @property
    def not_different_from_above(self) -> bool:
        """The 95% interval of the difference from the entry above contains 0 (False for the first)."""
        return self.versus_above is not None and not self.versus_above.significant


def leaderboard(session: Session, suite: str, *, definition_hash: str | None = None,
                include_nonstandard: bool = False, limit: int = 100) -> list[LeaderboardEntry]:
    """Each policy's comparable finished evaluations on ``suite`` pooled, best pooled success rate first.

    ``definition_hash``: one version of the suite (``Suite.definition_hash()``), the only
    evaluations that are comparable with each other; callers pass the suite's current one
    unless a reader asks for an older version. Evaluations made before definitions were
    recorded (NULL) are on no version. ``None`` ranks across every definition.

    Pooled (docs/statistics.md, "Leaderboard"): a policy's entry sums the scored and succeeded
    episodes of all its eligible evaluations (``leaderboard_eligibility``) that share inference
    settings — a policy run with other settings is another entry, marked by its ``inference``.
    Rate: pooled successes / pooled scored, with the Wilson 95% interval of those counts. Ties go
    to more episodes (the higher Wilson lower bound), then to the earlier latest result.
    Each entry after the first carries ``versus_above`` (``NeighbourDifference``).
    Four queries whatever the number of entries (pools, policies, contributing evaluations, their
    episodes' outcomes), the last split per ``OUTCOME_BATCH`` evaluations.
    """
    conditions = [Evaluation.suite == suite, *leaderboard_eligibility(include_nonstandard=include_nonstandard)]
    if definition_hash is not None:
        conditions.append(Evaluation.definition_hash == definition_hash)
    scored = func.sum(Evaluation.episodes_scored)
    succeeded = func.sum(Evaluation.episodes_succeeded)
    latest = func.max(Evaluation.finished_at)
    rate = succeeded * 1.0 / scored
    # One GROUP BY over the evaluations' stored counts (episodes_scored / episodes_succeeded are the
    # scored episodes' counts, written at finalisation): no episode row is read to rank.
    pools = session.execute(
        select(Evaluation.policy_id, Evaluation.inference, scored, succeeded, latest)
        .where(*conditions).group_by(Evaluation.policy_id, Evaluation.inference)
        .order_by(rate.desc(), scored.desc(), latest.asc(), Evaluation.policy_id.asc()).limit(limit)).all()
    if not pools:
        return []
    policy_ids = sorted({row[0] for row in pools})
    policies = {p.id: p for p in session.scalars(select(Policy).where(Policy.id.in_(policy_ids)))}
    contributors: dict[tuple[int, str], list[int]] = {}
    for evaluation_id, policy_id, inference in session.execute(
            select(Evaluation.id, Evaluation.policy_id, Evaluation.inference)
            .where(*conditions, Evaluation.policy_id.in_(policy_ids)).order_by(Evaluation.id)):
        contributors.setdefault((policy_id, _inference_key(inference)), []).append(evaluation_id)
    # Every ranked pool's scored outcomes in one pass (a query per OUTCOME_BATCH evaluations, not one per entry).
    pool_of = {evaluation_id: rank for rank, (policy_id, inference, *_) in enumerate(pools)
               for evaluation_id in contributors[(policy_id, _inference_key(inference))]}
    pool_outcomes = _scored_outcomes_by_pool(session, pool_of)
    entries: list[LeaderboardEntry] = []
    above_outcomes: dict[tuple[str, int], list[bool]] | None = None
    for rank, (policy_id, inference, pooled_scored, pooled_succeeded, finished_at) in enumerate(pools, start=1):
        evaluation_ids = contributors[(policy_id, _inference_key(inference))]
        outcomes = pool_outcomes.get(rank - 1, {})
        versus_above = None
        if above_outcomes is not None:
            above = entries[-1]
            versus_above = _neighbour_difference(above_outcomes, above.successes, above.episodes,
                                                 outcomes, int(pooled_succeeded), int(pooled_scored))
        ci_low, ci_high = wilson_interval(int(pooled_succeeded), int(pooled_scored))  # type: ignore[misc]
        entries.append(LeaderboardEntry(
            rank=rank, policy=policies[policy_id], evaluation_ids=evaluation_ids,
            success_rate=int(pooled_succeeded) / int(pooled_scored), ci_low=ci_low, ci_high=ci_high,
            episodes=int(pooled_scored), successes=int(pooled_succeeded), finished_at=finished_at,
            inference=inference or None, versus_above=versus_above))
        above_outcomes = outcomes
    return entries


def _inference_key(inference: Mapping[str, Any] | None) -> str:
    """Inference settings as a canonical string, to match an evaluation to its pool (None and {}: the defaults)."""
    return json.dumps(dict(inference or {}), sort_keys=True)


OUTCOME_BATCH = 1000  # evaluations per query when the leaderboard reads its pools' episode outcomes


def _scored_outcomes_by_pool(session: Session, pool_of: Mapping[int, int]
                             ) -> dict[int, dict[tuple[str, int], list[bool]]]:
    """pool → (task, seed) → success of each scored episode (``aggregates.is_scored``) of the pool's
    evaluations (``pool_of``: evaluation id → pool), in evaluation then episode order (a seed run twice has
    two). One query per ``OUTCOME_BATCH`` evaluations, whatever the number of pools."""
    outcomes: dict[int, dict[tuple[str, int], list[bool]]] = {}
    evaluation_ids = sorted(pool_of)
    succeeded = EpisodeStatus.SUCCEEDED.value  # read once: an enum member's .value is slow in a loop of 10⁵ rows
    for start in range(0, len(evaluation_ids), OUTCOME_BATCH):
        rows = session.execute(
            select(Episode.evaluation_id, Episode.task, Episode.seed, Episode.status, Episode.failure_reason)
            .where(Episode.evaluation_id.in_(evaluation_ids[start:start + OUTCOME_BATCH]),
                   Episode.status.in_((EpisodeStatus.SUCCEEDED.value, EpisodeStatus.FAILED.value)))
            .order_by(Episode.evaluation_id, Episode.episode_index))
        for evaluation_id, task, seed, status, failure_reason in rows:
            if is_scored(status, failure_reason):
                pool = outcomes.setdefault(pool_of[evaluation_id], {})
                pool.setdefault((task, seed), []).append(status == succeeded)
    return outcomes


def _neighbour_difference(above: Mapping[tuple[str, int], list[bool]], above_successes: int, above_scored: int,
                          below: Mapping[tuple[str, int], list[bool]], below_successes: int,
                          below_scored: int) -> NeighbourDifference:
    """The lower entry less the upper one: paired on the (task, seed) pairs both scored (a seed scored
    k times on one side and m on the other makes min(k, m) pairs, in evaluation order), else unpaired."""
    a = b = c = d = 0  # baseline: the entry above; candidate: this one (statistics' orientation)
    for key in above.keys() & below.keys():
        for upper, lower in zip(above[key], below[key], strict=False):
            if upper and lower:
                a += 1
            elif upper:
                b += 1
            elif lower:
                c += 1
            else:
                d += 1
    pairs = a + b + c + d
    if pairs:
        low, high = newcombe_paired_interval(a, b, c, d)  # type: ignore[misc]  # pairs > 0
        return NeighbourDifference(difference=(c - b) / pairs, ci_low=low, ci_high=high, method="paired",
                                   pairs=pairs, p_value=mcnemar_exact(b, c))
    low, high = newcombe_unpaired_interval(below_successes, below_scored,  # type: ignore[misc]  # both > 0
                                           above_successes, above_scored)
    return NeighbourDifference(difference=below_successes / below_scored - above_successes / above_scored,
                               ci_low=low, ci_high=high, method="unpaired")


def has_definition(session: Session, suite: str, definition_hash: str) -> bool:
    """Whether any evaluation of ``suite`` was made under ``definition_hash`` (a leaderboard version exists)."""
    found = session.scalar(select(Evaluation.id).where(Evaluation.suite == suite,
                                                       Evaluation.definition_hash == definition_hash).limit(1))
    return found is not None


# ---------------------------------------------------------------------------- workers


def record_worker_heartbeat(session: Session, worker_id: str, *, host: str, simulators: Mapping[str, Any],
                            now: datetime | None = None) -> None:
    """A worker says it is alive and which simulator families it serves (inserted the first time)."""
    now = now or utcnow()
    updated = session.execute(update(Worker).where(Worker.id == worker_id)
                              .values(last_seen_at=now, host=host, simulators=dict(simulators))
                              .execution_options(synchronize_session=False)).rowcount
    if not updated:
        session.add(Worker(id=worker_id, host=host, simulators=dict(simulators), started_at=now, last_seen_at=now))
        try:
            session.commit()
        except IntegrityError:  # its previous heartbeat's insert raced this one: nothing left to do
            session.rollback()
        return
    session.commit()


def remove_worker(session: Session, worker_id: str) -> None:
    """A worker that stops cleanly takes its row with it."""
    session.execute(delete(Worker).where(Worker.id == worker_id))
    session.commit()


def live_workers(session: Session, *, seen_after: datetime) -> list[Worker]:
    """Workers whose last heartbeat is newer than ``seen_after``, by id."""
    return list(session.scalars(select(Worker).where(Worker.last_seen_at > seen_after).order_by(Worker.id)))


def live_simulators(session: Session, *, seen_after: datetime) -> dict[str, int]:
    """``{simulator family: live workers serving it}``."""
    counts: dict[str, int] = {}
    for worker in live_workers(session, seen_after=seen_after):
        for family in worker.simulators:
            counts[family] = counts.get(family, 0) + 1
    return counts
