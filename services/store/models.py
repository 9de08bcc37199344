"""The store's tables as SQLAlchemy 2 typed models: policies, evaluations, episodes, API keys.

Alembic owns the schema (``migrations/``); these classes describe it, and a test
proves the two agree. Identifiers are 64-bit integers (``INTEGER`` on SQLite, where
only that type aliases the rowid). Timestamps are timezone-aware UTC on both
backends (``UtcDateTime``). Statuses are short strings with a CHECK constraint
rather than database enums, so adding a state is a plain migration; the enums
themselves are ``statuses``' (re-exported here).

Indexes and who needs them:

- ``episodes (evaluation_id, episode_index)`` unique: one row per episode of an
  evaluation (a redelivered task can never create a second one), episode listing
  in index order, and per-evaluation aggregates.
- ``episodes (status, lease_expires_at)``: the sweeper's "pending too long / lease
  expired" scan.
- ``evaluations (suite, status, policy_id, success_rate)``: the leaderboard (each policy's
  finished evaluations in a suite, pooled from their stored counts) without touching episodes.
- ``evaluations (suite, definition_hash)``: one leaderboard version, the evaluations
  made under one definition of a suite (``Suite.definition_hash``).
- ``evaluations (policy_id, id)``, ``(status, id)``, ``(suite, id)``: filtered
  listings, newest first, keyset-paginated on ``id``.
- ``evaluation_tags (tag, evaluation_id)``: the listing's tag filter.
- ``evaluations (created_by_key_id, idempotency_key)`` unique: an ``Idempotency-Key``
  replays only the evaluation the same API key made with it.
- ``evaluations (id) WHERE episodes_unmaterialized > 0`` (partial): the few large evaluations
  whose episode rows are still being written after their 202, which the sweeper finishes.

Ownership: policies and evaluations record the API key that created them
(``created_by_key_id``; NULL for rows made before migration 0003, which only an
admin key can change). API keys carry scopes (``ApiKeyScope``).
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# The statuses and failure reasons are defined once, without SQLAlchemy; importers of this module keep them.
from services.store.statuses import (  # noqa: F401  (re-exported)
    HARNESS_FAILURES,
    TERMINAL_EPISODE_STATUSES,
    EpisodeStatus,
    EvaluationStatus,
    FailureReason,
    PolicyProtocol,
    RecordMode,
)

# 64-bit keys on PostgreSQL; on SQLite only "INTEGER PRIMARY KEY" is the auto-assigned rowid.
BigId = BigInteger().with_variant(Integer(), "sqlite")
JsonDoc = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    """Now, timezone-aware UTC (the only kind of datetime the store accepts)."""
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """``TIMESTAMP WITH TIME ZONE`` that reads back aware UTC on PostgreSQL and SQLite alike.

    SQLite has no time zones: values are stored as naive UTC text (which sorts and
    compares correctly) and get ``tzinfo=UTC`` back on load. Naive input is refused,
    because a local time silently stored as UTC would shift leases by hours.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store needs timezone-aware values "
                             "(use services.store.models.utcnow())")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _check_in(column: str, values: type[enum.StrEnum], name: str) -> CheckConstraint:
    allowed = ", ".join(f"'{v.value}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=name)


# An episode that is not finished yet, as SQL literals (the partial index ix_episodes_live_evaluation_id
# and the queries that should use it: a planner matches the predicate only against literal values).
LIVE_EPISODE_SQL = f"status IN ('{EpisodeStatus.PENDING.value}', '{EpisodeStatus.RUNNING.value}')"


# An evaluation whose episode rows are still being written (the partial index ix_evaluations_unmaterialized).
UNMATERIALIZED_SQL = "episodes_unmaterialized > 0"


# Deterministic constraint names on both backends, so later migrations can name what they drop.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class ApiKeyScope(enum.StrEnum):
    """What an API key may do; each scope includes the ones before it."""

    READ = "read"  # read (where reads need a key) and nothing else
    SUBMIT = "submit"  # register policies, submit evaluations, change and cancel its own
    ADMIN = "admin"  # everything, including other keys' policies and evaluations


class Base(DeclarativeBase):
    """Every table of the store; ``Base.metadata`` is what Alembic compares migrations against."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Policy(Base):
    """A policy server registered for evaluation, with what its handshake said."""

    __tablename__ = "policies"
    __table_args__ = (UniqueConstraint("name", "version"), _check_in("protocol", PolicyProtocol, "protocol"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[str] = mapped_column(String(100))
    endpoint: Mapped[str] = mapped_column(String(2000))
    protocol: Mapped[str] = mapped_column(String(16), default=PolicyProtocol.EVALFORGE.value,
                                          server_default=PolicyProtocol.EVALFORGE.value)
    # None where the server does not say (openpi's metadata is free-form): an evaluation then takes
    # the action dimension from its suite and checks every reply against it.
    checkpoint_sha256: Mapped[str | None] = mapped_column(String(64))
    revision: Mapped[str | None] = mapped_column(String(64))  # names the checkpoint where there is no sha256
    state_dim: Mapped[int | None] = mapped_column(Integer)
    action_dim: Mapped[int | None] = mapped_column(Integer)
    chunk_size: Mapped[int | None] = mapped_column(Integer)
    tasks: Mapped[list[str]] = mapped_column(JsonDoc)  # [] from a server that takes any instruction
    # canonical field (state, task, images.<camera>) -> the key the server reads; None: the protocol's defaults.
    observation_keys: Mapped[dict[str, str] | None] = mapped_column(JsonDoc)
    # What the server said at registration (its metadata or hello reply), a capped JSON summary.
    server_info: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    # {camera: [height, width]} the server's handshake asks for; None (rows before 0006) or {}: state only.
    cameras: Mapped[dict[str, list[int]] | None] = mapped_column(JsonDoc)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    # The key that registered it: only that key (or an admin) may point it at another endpoint.
    created_by_key_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("api_keys.id", ondelete="SET NULL"))
    # Further servers of the same checkpoint (replicas); ``endpoint`` stays the first one.
    replicas: Mapped[list[PolicyEndpoint]] = relationship(
        lazy="selectin", order_by="PolicyEndpoint.id", cascade="all, delete-orphan", passive_deletes=True)

    @property
    def endpoints(self) -> list[str]:
        """Every server of this policy: ``endpoint`` first, then its replicas in the order they were added."""
        return [self.endpoint, *(r.endpoint for r in self.replicas if r.endpoint != self.endpoint)]


class PolicyEndpoint(Base):
    """One more server of a policy's checkpoint (a replica), checked by its handshake when added.

    Workers spread a policy's episodes over ``policy.endpoint`` and these, and fail over between
    them (``services/workers/replicas.py``)."""

    __tablename__ = "policy_endpoints"
    __table_args__ = (UniqueConstraint("policy_id", "endpoint"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    policy_id: Mapped[int] = mapped_column(BigId, ForeignKey("policies.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(2000))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    created_by_key_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("api_keys.id", ondelete="SET NULL"))


class Evaluation(Base):
    """One request to evaluate a policy on a suite; owns one row per episode.

    The result columns (``episodes_scored`` … ``aggregates``) are written once, by
    ``finalize_evaluation_if_done``; until then the API computes them live.

    The row is the plan: its tasks, episodes per task, and its protocol's step limits and first
    seed determine every episode (``queries.planned_episodes``). A small evaluation gets all its
    episode rows in the transaction that creates it; a large one gets them after the 202, in
    chunks (``queries.materialize_episodes``): ``episodes_unmaterialized`` counts the rows not
    written yet — always the last ones, indexes ``episodes_total - episodes_unmaterialized`` on.
    """

    __tablename__ = "evaluations"
    __table_args__ = (
        _check_in("status", EvaluationStatus, "status"),
        _check_in("record", RecordMode, "record"),
        Index("ix_evaluations_leaderboard", "suite", "status", "policy_id", "success_rate"),
        Index("ix_evaluations_policy_id_id", "policy_id", "id"),
        Index("ix_evaluations_status_id", "status", "id"),
        Index("ix_evaluations_suite_id", "suite", "id"),
        Index("ix_evaluations_suite_definition_hash", "suite", "definition_hash"),
        UniqueConstraint("created_by_key_id", "idempotency_key"),
        # The sweeper's "whose episode rows are still to write?" (migration 0013): only those rows.
        Index("ix_evaluations_unmaterialized", "id", postgresql_where=text(UNMATERIALIZED_SQL),
              sqlite_where=text(UNMATERIALIZED_SQL)),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    policy_id: Mapped[int] = mapped_column(BigId, ForeignKey("policies.id", ondelete="RESTRICT"))
    suite: Mapped[str] = mapped_column(String(200))
    tasks: Mapped[list[str]] = mapped_column(JsonDoc)
    episodes_per_task: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    max_steps: Mapped[int | None] = mapped_column(Integer)  # None: each task's own limit
    # Every task of the suite at its standard step limits: comparable on the leaderboard.
    standard: Mapped[bool] = mapped_column(Boolean)
    # {camera: [height, width]} the workers render and send at each inference step; None or {}: none.
    cameras: Mapped[dict[str, list[int]] | None] = mapped_column(JsonDoc)
    # {"action_horizon": k | None, "temporal_ensemble": m | None}; None (rows before 0007): the defaults.
    inference: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    # What produced its numbers (services.store.provenance.build_protocol); None before migration 0009.
    protocol: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    # Suite.definition_hash() when it was made: its leaderboard version. None before migration 0009.
    definition_hash: Mapped[str | None] = mapped_column(String(64))
    # Which episodes are recorded for a LeRobot dataset (RecordMode); not part of the protocol.
    record: Mapped[str] = mapped_column(String(16), default=RecordMode.NONE.value,
                                        server_default=RecordMode.NONE.value)
    status: Mapped[str] = mapped_column(String(16), default=EvaluationStatus.PENDING.value)
    # The key that submitted it: only that key (or an admin) may cancel it; idempotency keys are per API key.
    created_by_key_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("api_keys.id", ondelete="SET NULL"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    episodes_total: Mapped[int] = mapped_column(Integer)
    # Episodes of the plan whose rows do not exist yet (the last ones); 0 once all do (migration 0013).
    # Finalisation waits for 0: an evaluation never finishes on the rows written so far.
    episodes_unmaterialized: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # Final results (set once, at finalisation).
    episodes_scored: Mapped[int | None] = mapped_column(Integer)
    episodes_succeeded: Mapped[int | None] = mapped_column(Integer)
    success_rate: Mapped[float | None] = mapped_column(Float)
    success_ci_low: Mapped[float | None] = mapped_column(Float)
    success_ci_high: Mapped[float | None] = mapped_column(Float)
    aggregates: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)

    policy: Mapped[Policy] = relationship(lazy="joined", innerjoin=True)
    tag_rows: Mapped[list[EvaluationTag]] = relationship(
        lazy="selectin", cascade="all, delete-orphan", order_by="EvaluationTag.tag")

    @property
    def tags(self) -> list[str]:
        return [row.tag for row in self.tag_rows]

    @property
    def finalised(self) -> bool:
        return self.finished_at is not None


class EvaluationTag(Base):
    """A free-form label on an evaluation (``baseline``, ``nightly``…), filterable in listings."""

    __tablename__ = "evaluation_tags"
    __table_args__ = (Index("ix_evaluation_tags_tag_evaluation_id", "tag", "evaluation_id"),)

    evaluation_id: Mapped[int] = mapped_column(BigId, ForeignKey("evaluations.id", ondelete="CASCADE"),
                                               primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), primary_key=True)


class Episode(Base):
    """One episode of an evaluation: what to run, who runs it, and what happened."""

    __tablename__ = "episodes"
    __table_args__ = (
        UniqueConstraint("evaluation_id", "episode_index"),
        _check_in("status", EpisodeStatus, "status"),
        CheckConstraint("failure_reason IS NULL OR failure_reason IN ("
                        + ", ".join(f"'{r.value}'" for r in FailureReason) + ")",
                        name="failure_reason"),
        Index("ix_episodes_status_lease_expires_at", "status", "lease_expires_at"),
        # The finalisation check's "any episode of this evaluation left?" (migration 0012): only the
        # live rows, so it stays small however large the evaluation and however many have finished.
        Index("ix_episodes_live_evaluation_id", "evaluation_id", postgresql_where=text(LIVE_EPISODE_SQL),
              sqlite_where=text(LIVE_EPISODE_SQL)),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    evaluation_id: Mapped[int] = mapped_column(BigId, ForeignKey("evaluations.id", ondelete="CASCADE"))
    episode_index: Mapped[int] = mapped_column(Integer)
    task: Mapped[str] = mapped_column(String(200))
    seed: Mapped[int] = mapped_column(BigInteger)
    max_steps: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=EpisodeStatus.PENDING.value)
    success: Mapped[bool | None] = mapped_column(Boolean)
    total_return: Mapped[float | None] = mapped_column(Float)
    steps: Mapped[int | None] = mapped_column(Integer)
    duration_s: Mapped[float | None] = mapped_column(Float)
    latency_mean_ms: Mapped[float | None] = mapped_column(Float)
    latency_p95_ms: Mapped[float | None] = mapped_column(Float)
    failure_reason: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    # The replay GIF (services/workers/replays.py), relative to the workers' ARTIFACT_ROOT; None: not recorded.
    artifact_path: Mapped[str | None] = mapped_column(String(1000))
    # Its rollout recording (services/workers/recording.py), relative to ARTIFACT_ROOT; None: not recorded.
    recording_path: Mapped[str | None] = mapped_column(String(1000))
    # {package: version} of the simulator it ran on (benchmarks.simulators); None before migration 0008.
    simulator_versions: Mapped[dict[str, str] | None] = mapped_column(JsonDoc)
    # Suites whose seeds pick one of a fixed set of initial states (LIBERO's): the one it started from.
    initial_state_index: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    # The host name of the worker that played it (worker_id names its process); None before migration 0009.
    worker_host: Mapped[str | None] = mapped_column(String(200))
    # What rendered its frames: MUJOCO_GL's backend (egl, osmesa) for MuJoCo simulators; None for others.
    renderer: Mapped[str | None] = mapped_column(String(32))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class Worker(Base):
    """A running ``evalforge worker``: the simulator families it serves, kept fresh by its heartbeat.

    ``simulators`` maps each family to its packages' versions (``benchmarks.simulators``). A
    worker whose ``last_seen_at`` is older than a few heartbeats is not live (it may have died
    without removing its row); ``queries.live_simulators`` is the API's view of the pools.
    """

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)  # the Celery node name
    host: Mapped[str] = mapped_column(String(200))
    simulators: Mapped[dict[str, dict[str, str]]] = mapped_column(JsonDoc)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class ApiKey(Base):
    """An API key. Only its SHA-256 is stored: keys are 256-bit random, so a fast hash is
    enough (no password-style stretching needed) and a leaked table reveals no key.

    ``scopes`` is a comma-separated list of ``ApiKeyScope`` values: ``read``, ``submit``
    or ``submit,admin`` (what ``services.store.api_keys`` writes).
    """

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the first characters, to recognise a key in listings
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    scopes: Mapped[str] = mapped_column(String(64), default=ApiKeyScope.SUBMIT.value)

    @property
    def scope_set(self) -> frozenset[ApiKeyScope]:
        return frozenset(ApiKeyScope(s) for s in self.scopes.split(",") if s)

    def allows(self, scope: ApiKeyScope) -> bool:
        """Whether this key may do what ``scope`` names (admin ⊃ submit ⊃ read)."""
        return grants(self.scope_set, scope)


def grants(scopes: frozenset[ApiKeyScope], wanted: ApiKeyScope) -> bool:
    """Whether a key holding ``scopes`` may do what ``wanted`` names: admin ⊃ submit ⊃ read."""
    order = list(ApiKeyScope)
    return any(order.index(held) >= order.index(wanted) for held in scopes)
