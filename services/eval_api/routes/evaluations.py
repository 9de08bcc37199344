"""``/evaluations``: submit (idempotently), list, read, page through or export episodes, download the
recorded rollouts as a LeRobot dataset, cancel."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.background import BackgroundTask

from benchmarks.simulators import install_hint
from services.eval_api.admission import check_queue_cap
from services.eval_api.datasets import DatasetError, NoRecordings, dataset_tar
from services.eval_api.deps import (
    EpisodeQueueDep,
    MetricsDep,
    ReadAccessDep,
    SessionDep,
    SettingsDep,
    WriteKeyDep,
)
from services.eval_api.errors import ApiError
from services.eval_api.exports import ExportFormat, encode_episodes, filename, provenance_columns
from services.eval_api.metrics import ApiMetrics
from services.eval_api.pagination import decode_page_cursor, encode_cursor, page_limit
from services.eval_api.planning import get_suite_entry, plan_evaluation, suites_by_name
from services.eval_api.schemas import (
    MAX_ID,
    EpisodeOut,
    EvaluationCreate,
    EvaluationDetail,
    EvaluationOut,
    Name,
    Page,
    Tag,
    error_responses,
)
from services.eval_api.settings import ApiSettings
from services.queue import EpisodeQueue
from services.store import queries
from services.store.aggregates import EpisodeResult, summarize, unranked_reason
from services.store.models import EpisodeStatus, Evaluation, EvaluationStatus, utcnow

router = APIRouter(prefix="/evaluations", tags=["evaluations"])

EvaluationId = Annotated[int, Path(ge=1, le=MAX_ID)]
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
    description="Retry-safe submission: the same key with the same body returns the same evaluation.")]


def evaluation_detail(evaluation: Evaluation, results: dict[str, Any],
                      waiting_for: str | None = None) -> EvaluationDetail:
    summary = EvaluationOut.model_validate(evaluation).model_dump()
    final = evaluation.status in (EvaluationStatus.FINISHED, EvaluationStatus.FAILED)
    return EvaluationDetail(**summary, counts=results["counts"], overall=results["overall"],
                            per_task=results["per_task"],
                            unranked_reason=unranked_reason(results["overall"]) if final else None,
                            waiting_for=waiting_for)


def waiting_for_workers(session: Session, evaluation: Evaluation, results: dict[str, Any],
                        settings: ApiSettings) -> str | None:
    """Why an evaluation's pending episodes are not being run, when no live worker can run its suite."""
    if evaluation.finished_at is not None or not results["counts"].get(EpisodeStatus.PENDING.value):
        return None
    simulator = get_suite_entry(evaluation.suite)["simulator"]
    live = queries.live_simulators(session, seen_after=utcnow() - timedelta(seconds=settings.worker_timeout_s))
    if live.get(simulator):
        return None
    return (f"no live worker runs simulator {simulator}: its episodes stay pending until one does (start "
            f"`evalforge worker --simulators {simulator}` where the {simulator} extra is installed: "
            f"{install_hint([simulator])})")


def _get_or_404(session: Session, evaluation_id: int) -> Evaluation:
    evaluation = queries.get_evaluation(session, evaluation_id)
    if evaluation is None:
        raise ApiError(404, "not_found", f"no evaluation with id {evaluation_id}; GET /evaluations lists them")
    return evaluation


def _request_sha256(body: EvaluationCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _enqueue(queue: EpisodeQueue, metrics: ApiMetrics, episode_ids: list[int], simulator: str | None) -> None:
    sent = queue.enqueue(episode_ids, simulator)
    metrics.episodes_enqueued.inc(sent)
    if sent < len(episode_ids):
        metrics.episodes_not_enqueued.inc(len(episode_ids) - sent)


def _materialize(session_factory: sessionmaker[Session], queue: EpisodeQueue, metrics: ApiMetrics,
                 evaluation_id: int, simulator: str | None) -> None:
    """Write a deferred evaluation's episode rows chunk by chunk, enqueuing each chunk after its commit
    (``queries.materialize_all``), with a session of its own (the route's is closed by now). A crash
    part-way leaves the rest to the sweeper, which finishes the materialisation."""
    with session_factory() as session:
        queries.materialize_all(session, evaluation_id, lambda ids: _enqueue(queue, metrics, ids, simulator))


@router.post("", status_code=202, response_model=EvaluationDetail,
             responses=error_responses(401, 403, 409, 413, 422, 429, 503))
def create_evaluation(body: EvaluationCreate, request: Request, response: Response, background: BackgroundTasks,
                      session: SessionDep, settings: SettingsDep, metrics: MetricsDep, episode_queue: EpisodeQueueDep,
                      caller: WriteKeyDep, idempotency_key: IdempotencyKey = None) -> EvaluationDetail:
    """Evaluate a policy on a suite: store the evaluation with one `pending` row per episode, then
    enqueue one task per episode. Answers 202 with the evaluation and its `Location`.

    An evaluation of more than 10,000 episodes is stored first and its episode rows are written
    after the 202, in chunks, each enqueued as it is committed; its `counts` say `pending` for the
    episodes not written yet, and it finishes only once every one of them has run.

    With `Idempotency-Key`, a retry with the same body returns the same evaluation (202,
    `Idempotent-Replayed: true`) and enqueues nothing; the same key with another body is a 409.
    Idempotency keys belong to the API key that sent them: another API key's use of the same
    string is a separate evaluation, never a replay of this one.
    """
    policy = queries.get_policy(session, body.policy_id)
    if policy is None:
        raise ApiError(422, "unknown_policy", f"no policy with id {body.policy_id}; register the policy server "
                       "with POST /policies first", {"policy_id": body.policy_id})
    plan = plan_evaluation(body, policy, max_episodes=settings.max_episodes_per_evaluation)
    check_queue_cap(session, len(plan.episodes), settings.max_queued_episodes)
    try:
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite=body.suite, tasks=plan.tasks,
            episodes_per_task=body.episodes_per_task, seed=body.seed, max_steps=body.max_steps,
            standard=plan.standard, tags=body.tags, episodes=plan.episodes, idempotency_key=idempotency_key,
            request_sha256=_request_sha256(body) if idempotency_key is not None else None,
            created_by_key_id=caller.key_id, cameras=plan.cameras, inference=plan.inference,
            protocol=plan.protocol, definition_hash=plan.definition_hash, record=body.record)
    except queries.IdempotencyConflict as exc:
        raise ApiError(409, "idempotency_conflict", str(exc), {"evaluation_id": exc.evaluation_id}) from exc
    evaluation = created.evaluation
    response.headers["Location"] = f"/evaluations/{evaluation.id}"
    if not created.created:
        response.headers["Idempotent-Replayed"] = "true"
        return evaluation_detail(evaluation, queries.evaluation_results(session, evaluation))
    metrics.evaluations_created.inc()
    simulator = get_suite_entry(body.suite)["simulator"]
    if evaluation.episodes_unmaterialized:
        # A large evaluation: its rows are written after the response, chunk by chunk, each chunk
        # enqueued after its commit; a crash part-way leaves the rest to the sweeper. The response
        # counts them pending without a row read (evaluation_results: none is written yet).
        background.add_task(_materialize, request.app.state.session_factory, episode_queue, metrics, evaluation.id,
                            simulator)
        return evaluation_detail(evaluation, queries.evaluation_results(session, evaluation))
    # After the commit above, and after the response is sent: publishing 1,000 tasks takes
    # longer than the insert, and a crash in between only leaves episodes pending for the sweeper.
    # On the queue of the suite's simulator family: only workers that can run it take them.
    background.add_task(_enqueue, episode_queue, metrics, created.episode_ids, simulator)
    results = summarize([EpisodeResult(task=spec.task, status=EpisodeStatus.PENDING.value)
                         for spec in plan.episodes], plan.tasks)
    return evaluation_detail(evaluation, results)


@router.get("", response_model=Page[EvaluationOut], responses=error_responses(401, 403, 422))
def list_evaluations(session: SessionDep, settings: SettingsDep, _read: ReadAccessDep,
                     policy_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
                     suite: Annotated[Name | None, Query()] = None,
                     status: Annotated[EvaluationStatus | None, Query()] = None,
                     tag: Annotated[Tag | None, Query()] = None,
                     cursor: Annotated[str | None, Query(max_length=200)] = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 50) -> Page[EvaluationOut]:
    """Evaluations, newest first, filtered by policy, suite, status and tag (all optional)."""
    limit = page_limit(limit, settings.max_page_size)
    rows = queries.list_evaluations(session, policy_id=policy_id, suite=suite,
                                    status=status.value if status else None, tag=tag,
                                    before_id=decode_page_cursor(cursor, "evaluation"), limit=limit + 1)
    items = [EvaluationOut.model_validate(row) for row in rows[:limit]]
    next_cursor = encode_cursor("evaluation", items[-1].id) if len(rows) > limit else None
    return Page(items=items, next_cursor=next_cursor)


@router.get("/{evaluation_id}", response_model=EvaluationDetail, responses=error_responses(401, 403, 404, 422))
def get_evaluation(evaluation_id: EvaluationId, session: SessionDep, settings: SettingsDep,
                   _read: ReadAccessDep) -> EvaluationDetail:
    """Status, episode counts by status, and per-task and overall results: success rate with its
    Wilson 95% interval, mean steps, policy latency p50/p95, failure reasons; `waiting_for` says
    when no live worker can run the suite's simulator (its episodes then stay pending); `protocol`
    what produced the numbers (suite definition, tasks and step limits, seeds, cameras, inference
    settings, the policy's identity, EvalForge's version and commit). Each episode records its
    worker's host and simulator versions (`GET /evaluations/{id}/episodes`)."""
    evaluation = _get_or_404(session, evaluation_id)
    results = queries.evaluation_results(session, evaluation)
    return evaluation_detail(evaluation, results, waiting_for_workers(session, evaluation, results, settings))


@router.get("/{evaluation_id}/episodes", response_model=Page[EpisodeOut],
            responses={200: {"content": {ExportFormat.CSV.media_type: {}, ExportFormat.JSONL.media_type: {}},
                             "description": "A page of episodes (JSON), or with `format` all of them, streamed."},
                       **error_responses(401, 403, 404, 422)})
def list_episodes(evaluation_id: EvaluationId, request: Request, session: SessionDep, settings: SettingsDep,
                  _read: ReadAccessDep, status: Annotated[EpisodeStatus | None, Query()] = None,
                  cursor: Annotated[str | None, Query(max_length=200)] = None,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
                  format: Annotated[ExportFormat | None, Query(description=(
                      "`csv` or `jsonl`: every episode (with `status`, those only), each with its evaluation's "
                      "provenance, streamed as a download; `cursor` and `limit` do not apply."))] = None,
                  ) -> Page[EpisodeOut] | StreamingResponse:
    """An evaluation's episodes in index order (optionally only those with `status`): a page of JSON,
    or with `format=csv|jsonl` all of them streamed, each row with its evaluation's provenance
    (services/eval_api/exports.py describes the columns)."""
    if format is not None:
        evaluation = _get_or_404(session, evaluation_id)
        return _export(request.app.state.session_factory, evaluation, format,
                       status.value if status else None)
    limit = page_limit(limit, settings.max_page_size)
    _get_or_404(session, evaluation_id)
    rows = queries.list_episodes(session, evaluation_id, after_index=decode_page_cursor(cursor, "episode"),
                                 status=status.value if status else None, limit=limit + 1)
    items = [EpisodeOut.model_validate(row) for row in rows[:limit]]
    next_cursor = encode_cursor("episode", items[-1].episode_index) if len(rows) > limit else None
    return Page(items=items, next_cursor=next_cursor)


def _export(session_factory: sessionmaker[Session], evaluation: Evaluation, export_format: ExportFormat,
            status: str | None) -> StreamingResponse:
    """The streamed export. It reads with a session of its own: the route's closes before the
    response is sent (services/eval_api/deps.py), and the stream outlives it."""
    provenance = provenance_columns(evaluation)

    def batches() -> Iterator[list[Any]]:
        with session_factory() as session:
            yield from queries.iter_episodes(session, evaluation.id, status=status)

    return StreamingResponse(encode_episodes(batches(), provenance, export_format),
                             media_type=export_format.media_type, headers={
                                 "Content-Disposition":
                                     f'attachment; filename="{filename(evaluation.id, export_format)}"'})


@router.get("/{evaluation_id}/dataset", response_class=FileResponse,
            responses={200: {"content": {"application/x-tar": {}},
                             "description": "The recorded episodes as a LeRobot v3 dataset, in a tar."},
                       **error_responses(401, 403, 404, 422)})
def download_dataset(evaluation_id: EvaluationId, session: SessionDep, settings: SettingsDep,
                     _read: ReadAccessDep) -> FileResponse:
    """The episodes its `record` mode kept, as one LeRobot v3 dataset (state, actions, camera videos,
    success, task text) that `trainer vla` trains on, in an uncompressed tar of the dataset's files
    (services/eval_api/datasets.py). Built from the recordings present now: a running evaluation gives
    those recorded so far. 404 `no_recordings` when there are none."""
    evaluation = _get_or_404(session, evaluation_id)
    rows = queries.recorded_episodes(session, evaluation_id)
    try:
        tar_path, scratch = dataset_tar(evaluation, rows, settings.artifact_root)
    except NoRecordings as exc:
        raise ApiError(404, "no_recordings", str(exc)) from exc
    except DatasetError as exc:
        raise ApiError(404, "recording_unavailable", str(exc)) from exc
    return FileResponse(tar_path, media_type="application/x-tar", filename=f"evaluation-{evaluation_id}-dataset.tar",
                        background=BackgroundTask(shutil.rmtree, scratch, ignore_errors=True))


@router.post("/{evaluation_id}/cancel", response_model=EvaluationDetail,
             responses=error_responses(401, 403, 404, 409, 422))
def cancel_evaluation(evaluation_id: EvaluationId, request: Request, background: BackgroundTasks,
                      session: SessionDep, metrics: MetricsDep, episode_queue: EpisodeQueueDep,
                      caller: WriteKeyDep) -> EvaluationDetail:
    """Cancel: pending episodes become `cancelled`, running ones finish. Cancelling twice is
    harmless; cancelling a finished or failed evaluation is a 409. Only the API key that submitted
    the evaluation, or an admin key, may cancel it (403 otherwise). A large evaluation whose
    episode rows are still being written gets the rest written `cancelled` (nothing more is
    enqueued), after the response; it is finalised when they are."""
    try:
        evaluation = queries.cancel_evaluation(session, evaluation_id, by_key_id=caller.owner_filter)
    except queries.NotOwner as exc:
        raise ApiError(403, "not_owner", f"{exc}; cancel your own evaluations, or ask an operator with an admin "
                       "key (`evalforge apikey create --scope admin`)") from exc
    except queries.NotFound as exc:
        raise ApiError(404, "not_found", f"{exc}; GET /evaluations lists them") from exc
    except queries.EvaluationAlreadyDone as exc:
        raise ApiError(409, "evaluation_finished", str(exc)) from exc
    if evaluation.episodes_unmaterialized:
        # Its chunks are written cancelled from now on, so nothing reaches the queue; the suite's
        # simulator is only what _materialize is given to publish with (None: a suite no longer known).
        simulator = suites_by_name().get(evaluation.suite, {}).get("simulator")
        background.add_task(_materialize, request.app.state.session_factory, episode_queue, metrics, evaluation.id,
                            simulator)
    return evaluation_detail(evaluation, queries.evaluation_results(session, evaluation))
