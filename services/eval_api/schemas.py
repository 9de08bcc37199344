"""Request and response bodies of the evaluation API (pydantic): the one definition of each.

Requests are strict: unknown fields are refused (``extra="forbid"``), numbers must
be JSON numbers, and text may not hold NUL characters or lone surrogates (which
PostgreSQL cannot store), so a bad request is always a 422 naming the field.

The response bodies are also what the HTTP client (``services/client.py``) returns:
it parses the API's JSON with these very classes. So this module imports pydantic and
the status enums (``services.store.statuses``) only, never FastAPI or SQLAlchemy, and
responses ignore fields they do not know (an older client reading a newer API).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from services.store.statuses import (
    FINAL_EVALUATION_STATUSES,
    TERMINAL_EPISODE_STATUSES,
    EpisodeStatus,
    EvaluationStatus,
    PolicyProtocol,
    RecordMode,
    inference_label,
)

MAX_ID = 2**63 - 1  # ids are 64-bit; larger numbers are refused before they reach the database
MAX_SEED = 1_000_000_000  # evaluation seeds (EVAL_SEED_START + seed + i) stay below 2**31 for every simulator


def _printable_text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from exc
    return value


# Bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069) make a name render as
# another on the pages and in terminals ("Trojan Source"); names, versions, tags and endpoints refuse them.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _no_bidi_controls(value: str) -> str:
    found = sorted({f"U+{ord(c):04X}" for c in value if c in _BIDI_CONTROLS})
    if found:
        raise ValueError(f"must not contain bidirectional control characters ({', '.join(found)}): they make "
                         "text display as something else; remove them")
    return value


def _no_credentials(value: str) -> str:
    netloc = value.split("://", 1)[-1].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" in netloc:
        raise ValueError("must not contain credentials (user:password@host): EvalForge neither sends nor stores "
                         "them; give the URL without them")
    return value


_NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
Text = Annotated[str, AfterValidator(_printable_text)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=_NO_CONTROL),
                 AfterValidator(_printable_text), AfterValidator(_no_bidi_controls)]
Version = Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=_NO_CONTROL),
                    AfterValidator(_printable_text), AfterValidator(_no_bidi_controls)]
# ASCII only, so no bidirectional controls either.
Tag = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/=+-]*$")]
Endpoint = Annotated[str, StringConstraints(min_length=6, max_length=2000, pattern=r"^wss?://[^\s/?#]+[^\s]*$"),
                     AfterValidator(_printable_text), AfterValidator(_no_bidi_controls),
                     AfterValidator(_no_credentials)]
Id = Annotated[int, Field(ge=1, le=MAX_ID)]
CameraName = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
CameraSize = Annotated[list[Annotated[int, Field(ge=16, le=1024)]], Field(min_length=2, max_length=2)]
Cameras = Annotated[dict[CameraName, CameraSize], Field(max_length=16)]
"""``{camera: [height, width]}``: what a policy asks to see, what an evaluation renders."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class _PolicyLabel:
    """``label`` of a body that has a policy's ``name`` and ``version``."""

    @property
    def label(self) -> str:
        """``name:version``, how the command line names a policy."""
        return f"{self.name}:{self.version}"  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable, machine-readable error code.")
    message: str = Field(description="What was wrong with which input, and how to fix it.")
    details: Any = Field(None, description="Structured extras (e.g. the failing fields).")


class ErrorOut(BaseModel):
    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for routes that can answer these error statuses."""
    return {status: {"model": ErrorOut} for status in statuses}


# ---------------------------------------------------------------------------- policies


ObservationKey = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=_NO_CONTROL)]


class PolicyCreate(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "bc", "endpoint": "ws://policy.test:8000/ws"},
        {"name": "pi05-libero", "endpoint": "ws://gpu-3:8000", "protocol": "openpi", "revision": "pi05-libero-v1",
         "action_dim": 4, "observation_keys": {"state": "observation/state", "images.corner": "observation/image",
                                               "images.gripper": "observation/wrist_image", "task": "prompt"}}]})

    name: Name = Field(description="Policy name, e.g. `metaworld-mt10-bc`.")
    version: Version | None = Field(None, description=(
        "Version label; default: the first 12 hex digits of the checkpoint's sha256, or the revision."))
    endpoint: Endpoint = Field(description="The policy server's WebSocket URL, e.g. `ws://gpu-3:8000/ws`.")
    protocol: Literal["evalforge", "openpi", "vla-eval"] = Field("evalforge", description=(
        "What the server speaks: `evalforge` (ours), `openpi` (openpi's WebsocketPolicyServer) or `vla-eval` "
        "(a vla-eval model server)."))
    observation_keys: dict[ObservationKey, ObservationKey] | None = Field(None, max_length=64, description=(
        "Canonical field (`state`, `task`, `images.<camera>`) → the key the server reads it from; default: "
        "the protocol's (docs/remote-policies.md). Not for `evalforge` servers."))
    action_dim: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Where the server does not say: its action dimension (default: each evaluation's suite's, every reply "
        "checked against it)."))
    chunk_size: int | None = Field(None, ge=1, le=1_000_000, description="Where the server does not say: "
                                   "actions per reply (informational; replies are checked by shape).")
    revision: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = Field(
        None, description="Names the checkpoint where the server has no sha256 (part of its leaderboard identity).")
    replicas: list[Endpoint] = Field(default_factory=list, max_length=64, description=(
        "More servers of the same checkpoint (replicas): each must answer the same handshake (same checkpoint "
        "sha256 or revision), else 409. Workers spread episodes over `endpoint` and these and fail over between "
        "them. `POST /policies/{id}/endpoints` adds one later."))


class PolicyEndpointCreate(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [{"endpoint": "ws://gpu-4:8000/ws"}]})

    endpoint: Endpoint = Field(description=(
        "Another server of the policy's checkpoint (a replica), e.g. `ws://gpu-4:8000/ws`: its handshake must "
        "name the same checkpoint sha256 (or revision) as the policy, else 409."))


class PolicySummary(_PolicyLabel, _Response):
    """A policy as ``GET /policies`` lists it: without its task list (``GET /policies/{id}`` has it), so a
    page of policies stays small whatever their servers announced."""

    id: int
    name: str
    version: str
    endpoint: str
    protocol: PolicyProtocol = PolicyProtocol.EVALFORGE
    checkpoint_sha256: str | None = Field(description="None for a server that names no sha256 (see `revision`).")
    revision: str | None = None
    state_dim: int | None
    action_dim: int | None = Field(description="None: each evaluation's suite's.")
    chunk_size: int | None
    task_count: int = Field(description="How many tasks the policy server announced (0: any instruction).")
    cameras: dict[str, list[int]] = Field(default_factory=dict, description=(
        "`{camera: [height, width]}` the server's handshake asks for; empty for a state-only policy."))
    created_at: datetime

    @field_validator("cameras", mode="before")
    @classmethod
    def _no_cameras(cls, cameras: Any) -> Any:
        """Rows written before cameras were recorded hold NULL: state only."""
        return {} if cameras is None else cameras

    @model_validator(mode="before")
    @classmethod
    def _count_tasks(cls, data: Any) -> Any:
        """``task_count`` from a row's (or a detail body's) ``tasks``."""
        if isinstance(data, dict):
            if "task_count" not in data and isinstance(data.get("tasks"), list):
                return {**data, "task_count": len(data["tasks"])}
            return data
        tasks = getattr(data, "tasks", None)
        if isinstance(tasks, list) and not hasattr(data, "task_count"):
            fields = {name: getattr(data, name) for name in cls.model_fields
                      if name != "task_count" and hasattr(data, name)}
            return {**fields, "task_count": len(tasks)}
        return data


class PolicyOut(PolicySummary):
    """One policy, with the tasks its server announced."""

    tasks: list[str]
    endpoints: list[str] = Field(default_factory=list, description=(
        "Every server of the policy: `endpoint` first, then its replicas; workers spread episodes over them."))
    observation_keys: dict[str, str] | None = Field(None, description=(
        "Where its server reads each canonical field (None: the protocol's defaults)."))
    server_info: dict[str, Any] | None = Field(None, description="What the server said at registration.")


class PolicyRef(_PolicyLabel, _Response):
    id: int
    name: str
    version: str
    checkpoint_sha256: str | None
    revision: str | None = None


# ---------------------------------------------------------------------------- evaluations


class InferenceSettings(BaseModel):
    """How the workers turn the policy's action chunks into the actions they execute.

    Part of what an evaluation measures (execution horizons and ensembling move success
    rates by tens of points), so stored with it, shown with its results, and marked on the
    leaderboard when not the defaults.
    """

    model_config = ConfigDict(extra="forbid")

    action_horizon: int | None = Field(None, ge=1, le=10_000, description=(
        "Execute the first k actions of each chunk, then ask again (LeRobot's n_action_steps, openpi's "
        "replan_steps); default: the whole chunk."))
    temporal_ensemble: float | None = Field(None, ge=0, le=10, description=(
        "ACT's temporal ensembling: a new chunk every step, the actions chunks predict for the same step "
        "averaged with weights exp(-m·i), i = 0 for the oldest; m = this value. Default: off."))

    @model_validator(mode="after")
    def _one_of(self) -> InferenceSettings:
        if self.action_horizon is not None and self.temporal_ensemble is not None:
            raise ValueError("action_horizon and temporal_ensemble exclude each other: ensembling asks for a "
                             "chunk every step; set one")
        return self

    @property
    def is_default(self) -> bool:
        return self.action_horizon is None and self.temporal_ensemble is None

    @property
    def label(self) -> str:
        """``whole chunk``, ``horizon 1`` or ``ensemble m=0.01``: how tables and pages name it."""
        return inference_label(self.model_dump())


class EvaluationCreate(_Request):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"policy_id": 1, "suite": "metaworld-mt10", "episodes_per_task": 10, "seed": 0},
        {"policy_id": 1, "suite": "metaworld-mt10", "episodes_per_task": 2, "seed": 100, "tasks": ["reach-v3"],
         "max_steps": 200, "tags": ["smoke"]}]})

    policy_id: Id = Field(description="A registered policy (`POST /policies`).")
    suite: Name = Field(description="Benchmark suite (`GET /suites`).")
    episodes_per_task: int = Field(ge=1, le=1_000_000, description="Episodes per task (capped by the server).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description=(
        "Episode i of each task runs evaluation seed `seed + i` (disjoint from demonstration seeds)."))
    tasks: list[Name] | None = Field(None, min_length=1, max_length=500,
                                     description="A subset of the suite's tasks; default: all of them.")
    max_steps: int | None = Field(None, ge=1, le=1_000_000,
                                  description="Step limit per episode, at most each task's own; default: the task's.")
    tags: list[Tag] = Field(default_factory=list, max_length=20, description="Labels to filter listings by.")
    cameras: Cameras | None = Field(None, description=(
        "`{camera: [height, width]}` to render and send at each inference step, from the suite's cameras "
        "(`GET /suites/{name}`); default: the cameras the policy's handshake asks for. A policy that "
        "declares cameras must get those, at its sizes."))
    inference: InferenceSettings = Field(default_factory=InferenceSettings, description=(
        "Inference settings (default: execute each whole chunk, no ensembling)."))
    record: Literal["none", "first", "failures", "all"] = Field("none", description=(
        "Episodes to record as a LeRobot v3 dataset (state, actions, camera videos, success; "
        "`GET /evaluations/{id}/dataset`): `none`, `first` (each task's first episode), `failures` (those that "
        "ran out of steps) or `all`. Changes no outcome and is not part of the protocol."))

    @field_validator("tasks")
    @classmethod
    def _distinct_tasks(cls, tasks: list[str] | None) -> list[str] | None:
        if tasks is not None:
            repeated = sorted({t for t in tasks if tasks.count(t) > 1})
            if repeated:
                raise ValueError(f"tasks must be distinct; repeated: {', '.join(repeated)}")
        return tasks


class Interval(BaseModel):
    low: float
    high: float


class Latency(BaseModel):
    p50: float | None = Field(description="Median of the episodes' mean policy latency, ms.")
    p95: float | None = Field(description="95th percentile of the episodes' p95 policy latency, ms.")


class Results(BaseModel):
    episodes: int
    scored: int = Field(description="Episodes that count toward the success rate (see the API docs).")
    succeeded: int
    success_rate: float | None
    ci95: Interval | None = Field(description="Wilson 95% interval of the success rate.")
    mean_steps: float | None
    latency_ms: Latency | None
    failure_reasons: dict[str, int]


class TaskResults(Results):
    task: str


class ProtocolTask(BaseModel):
    name: str
    max_steps: int = Field(description="The step limit its episodes ran with.")


class ProtocolSeeds(BaseModel):
    seed: int
    episodes_per_task: int
    first_seed: int = Field(description="The simulator seed of each task's first episode (then +1 per episode).")
    rule: str = Field(description="How the suite turns a seed into an initial state (`Suite.seed_rule`).")


class ProtocolPolicy(BaseModel):
    id: int
    name: str
    version: str
    protocol: str = Field(description="The wire protocol its server speaks.")
    checkpoint_sha256: str | None
    revision: str | None = Field(description="Names the checkpoint where its server gives no sha256.")


class ProtocolSoftware(BaseModel):
    version: str | None = Field(description="The `evalforge` distribution's version on the API host.")
    source_commit: str | None = Field(description="The git commit of the API's code; null outside a checkout.")


class ProtocolOut(BaseModel):
    """What produced an evaluation's numbers, recorded when it was created (see `services.store.provenance`).

    The simulator package versions, the renderer and the host are per episode (`EpisodeOut`)."""

    format_version: int
    suite: str
    definition_hash: str = Field(description=(
        "SHA-256 of the suite's definition (tasks, step limits, dimensions, bounds, rate, cameras, seed rule): "
        "its leaderboard version."))
    simulator: str = Field(description="The suite's simulator family.")
    tasks: list[ProtocolTask]
    seeds: ProtocolSeeds
    cameras: dict[str, list[int]]
    inference: InferenceSettings
    policy: ProtocolPolicy
    evalforge: ProtocolSoftware


class EvaluationOut(_Response):
    id: int
    policy: PolicyRef
    suite: str
    tasks: list[str]
    episodes_per_task: int
    seed: int
    max_steps: int | None
    standard: bool = Field(description="Every task of the suite at its standard step limits (leaderboard-eligible).")
    cameras: dict[str, list[int]] = Field(default_factory=dict, description=(
        "`{camera: [height, width]}` the workers rendered and sent to the policy; empty: state only."))
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    protocol: ProtocolOut | None = Field(None, description=(
        "The protocol that produced its numbers; null for evaluations made before protocols were recorded."))
    record: RecordMode = Field(RecordMode.NONE, description="Which episodes are recorded for its dataset.")
    tags: list[str]
    status: EvaluationStatus
    episodes_total: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancelled_at: datetime | None
    success_rate: float | None = Field(description="Final success rate (set once the evaluation is finalised).")

    @field_validator("cameras", mode="before")
    @classmethod
    def _no_cameras(cls, cameras: Any) -> Any:
        """Rows written before cameras were recorded hold NULL: state only."""
        return {} if cameras is None else cameras

    @field_validator("inference", mode="before")
    @classmethod
    def _default_inference(cls, inference: Any) -> Any:
        """Rows written before inference settings were recorded hold NULL: the defaults."""
        return {} if inference is None else inference


class EvaluationDetail(EvaluationOut):
    counts: dict[str, int] = Field(description="Episodes per status.")
    overall: Results
    per_task: list[TaskResults]
    unranked_reason: str | None = Field(None, description=(
        "Set once finished when most of its episodes were harness failures: why the leaderboard leaves "
        "it out."))
    waiting_for: str | None = Field(None, description=(
        "Set while episodes are pending and no live worker serves the suite's simulator family: what to start."))

    @property
    def episodes_done(self) -> int:
        """Episodes that reached a terminal status."""
        return sum(self.counts.get(status, 0) for status in TERMINAL_EPISODE_STATUSES)

    @property
    def done(self) -> bool:
        """Nothing changes any more (finished, cancelled or failed)."""
        return self.status in FINAL_EVALUATION_STATUSES


class EpisodeOut(_Response):
    id: int
    episode_index: int
    task: str
    seed: int
    max_steps: int
    status: EpisodeStatus
    success: bool | None
    total_return: float | None
    steps: int | None
    duration_s: float | None
    latency_mean_ms: float | None
    latency_p95_ms: float | None
    failure_reason: str | None
    error_message: str | None
    artifact_path: str | None = Field(None, description=(
        "Replay GIF of the episode, relative to the workers' `ARTIFACT_ROOT` (the first "
        "`EVALFORGE_REPLAY_EPISODES` episodes of an evaluation have one); null when none was recorded."))
    simulator_versions: dict[str, str] | None = Field(None, description=(
        "`{package: version}` of the simulator the episode ran on (null for episodes not run, or recorded "
        "before versions were)."))
    renderer: str | None = Field(None, description=(
        "What rendered its frames: for MuJoCo simulators `MUJOCO_GL`'s OpenGL backend (`egl`, `osmesa`); "
        "null for other simulators and for episodes not run or recorded before renderers were."))
    initial_state_index: int | None = Field(None, description=(
        "For suites whose seeds pick one of a fixed set of initial states (LIBERO's official ones): which."))
    recording_path: str | None = Field(None, description=(
        "Its rollout recording (the evaluation's `record` kept it), relative to the workers' `ARTIFACT_ROOT`; "
        "`GET /evaluations/{id}/dataset` joins them into a LeRobot dataset. Null when not recorded."))
    attempts: int
    worker_id: str | None
    worker_host: str | None = Field(None, description=(
        "The host of the worker that played it (null for episodes not run, or recorded before hosts were)."))
    started_at: datetime | None
    finished_at: datetime | None


ItemT = TypeVar("ItemT")


class Page(BaseModel, Generic[ItemT]):
    items: list[ItemT]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


# ---------------------------------------------------------------------------- leaderboard, suites, health


class DifferenceFromAbove(BaseModel):
    difference: float = Field(description="This entry's success rate less the one ranked above it.")
    ci95: Interval = Field(description="95% interval of the difference (Newcombe's method 10).")
    method: Literal["paired", "unpaired"] = Field(description=(
        "`paired`: on the (task, seed) episodes both entries scored (they share seeds); `unpaired`: the "
        "whole pools as independent samples (they share none)."))
    pairs: int | None = Field(default=None, description="The (task, seed) pairs compared (paired only).")
    p_value: float | None = Field(default=None, description="Exact McNemar p-value (paired only).")


class LeaderboardEntryOut(BaseModel):
    rank: int
    policy: PolicyRef
    evaluation_id: int = Field(description="The latest of `evaluation_ids` (the one to open for details).")
    evaluation_ids: list[int] = Field(description=(
        "The comparable evaluations whose scored episodes are pooled in this entry, oldest first."))
    inference: InferenceSettings = Field(default_factory=InferenceSettings, description=(
        "The evaluations' inference settings (each setting is its own entry); other than the defaults are marked."))
    success_rate: float = Field(description="Pooled successes / pooled scored episodes.")
    ci95: Interval = Field(description="Wilson 95% interval of the pooled counts.")
    episodes: int = Field(description="Scored episodes behind the success rate, pooled.")
    successes: int
    finished_at: datetime = Field(description="When the latest contributing evaluation finished.")
    not_different_from_above: bool = Field(description=(
        "The 95% interval of the difference from the entry ranked above contains 0 (false for the first)."))
    difference_from_above: DifferenceFromAbove | None = Field(default=None, description="None for the first entry.")


class LeaderboardOut(BaseModel):
    suite: str
    definition_hash: str = Field(description=(
        "The version of the suite ranked: only evaluations made under this definition are comparable here."))
    current_definition: bool = Field(description="Whether that is the suite's current definition.")
    include_nonstandard: bool
    entries: list[LeaderboardEntryOut]


class SuiteTask(BaseModel):
    name: str
    instruction: str
    max_steps: int


class SuiteCamera(BaseModel):
    name: str
    height: int = Field(description="Default height in pixels (an evaluation may ask for another size).")
    width: int
    description: str = ""


class SuiteOut(BaseModel):
    name: str
    simulator: str
    description: str
    state_dim: int
    state_names: list[str] = Field(default_factory=list, description=(
        "What each value of the state vector is (pixel suites leave out what only the image shows)."))
    action_dim: int
    action_names: list[str] = Field(default_factory=list)
    action_low: list[float]
    action_high: list[float]
    fps: float
    has_expert: bool
    cameras: list[SuiteCamera] = Field(default_factory=list, description="Cameras the simulator renders.")
    overview_camera: str | None = Field(None, description="The camera replays use for an overview.")
    tasks: list[SuiteTask]


class WorkerOut(_Response):
    id: str = Field(description="The worker's Celery node name.")
    host: str
    simulators: dict[str, dict[str, str]] = Field(description=(
        "The simulator families it serves, each with its packages' versions."))
    started_at: datetime
    last_seen_at: datetime


class HealthOut(BaseModel):
    status: str
    instance: str | None = Field(None, description=(
        "EVALFORGE_INSTANCE_TOKEN of this process (set by the supervisor of `evalforge up`), so a health "
        "check knows it reached its own child."))


class ReadyOut(BaseModel):
    status: str
    checks: dict[str, str]



# ---------------------------------------------------------------------------- comparisons


class ComparisonRow(BaseModel):
    """One task's paired comparison (or the overall one): episodes paired by (task, seed)."""

    task: str | None = Field(description="The task; null for the overall row (every pair of every task).")
    pairs: int = Field(description="(task, seed) pairs scored on both sides: the n of the comparison.")
    baseline_rate: float | None = Field(description="Baseline success rate over the pairs (null without pairs).")
    candidate_rate: float | None
    difference: float | None = Field(description="Candidate − baseline success rate over the pairs.")
    ci95: Interval | None = Field(description=(
        "95% interval of the difference: Newcombe (1998) method 10 for paired proportions."))
    p_value: float | None = Field(description=(
        "Two-sided exact McNemar p-value (binomial test on the discordant pairs); 1 with no discordant pair."))
    both_succeeded: int = Field(description="a: pairs where both succeeded.")
    baseline_only: int = Field(description="b: pairs where only the baseline succeeded.")
    candidate_only: int = Field(description="c: pairs where only the candidate succeeded.")
    both_failed: int = Field(description="d: pairs where both failed.")


class ComparisonSide(BaseModel):
    """One side of a comparison: its evaluation and what of it was left out of the pairs."""

    evaluation: EvaluationOut
    scored: int = Field(description="Its scored episodes (succeeded or failed, not harness failures).")
    harness_failures: dict[str, int] = Field(description=(
        "Episodes left out of both sides as harness failures, by failure reason (their partners are unpaired)."))
    cancelled: int
    unfinished: int = Field(description="Episodes still pending or running (a live comparison).")


class UnpairedEpisode(BaseModel):
    """A scored episode whose (task, seed) is not scored on the other side, and why."""

    task: str
    seed: int
    side: Literal["baseline", "candidate"]
    episode_id: int
    reason: str


class DiscordantPair(BaseModel):
    """A (task, seed) on which exactly one side succeeded; both episodes, with their replays where recorded."""

    task: str
    seed: int
    succeeded: Literal["baseline", "candidate"] = Field(description="The side that succeeded.")
    baseline_episode_id: int
    candidate_episode_id: int
    baseline_artifact_path: str | None = None
    candidate_artifact_path: str | None = None


class ComparisonOut(BaseModel):
    """``GET /comparisons``: a paired comparison of two evaluations of the same protocol."""

    baseline: ComparisonSide
    candidate: ComparisonSide
    live: bool = Field(description="Either evaluation is not finished: the figures cover the pairs so far.")
    verdict: str = Field(description=(
        "The overall exact McNemar test at alpha in words: `candidate better (p = 0.003, n = 200)`, "
        "`baseline better (…)` or `no detectable difference at n = 50 (p = 0.41)` — which is not \"equal\"."))
    alpha: float = Field(description="The verdict's two-sided significance level.")
    interval_method: str = Field(description="How `ci95` is computed.")
    test_method: str = Field(description="How `p_value` is computed.")
    overall: ComparisonRow
    per_task: list[ComparisonRow]
    unpaired: list[UnpairedEpisode] = Field(description="Unpaired scored episodes (the first 1,000).")
    unpaired_total: int
    discordant: list[DiscordantPair] = Field(description=(
        "Pairs on which exactly one side succeeded (the first 1,000), in task order then seed."))
    discordant_total: int
