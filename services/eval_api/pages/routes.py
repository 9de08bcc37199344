"""The HTML pages' routes: the leaderboard, an evaluation, a policy (see the package docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader
from sqlalchemy.orm import Session

from benchmarks.registry import get_suite
from services.eval_api.deps import Credentials, SessionDep, SettingsDep, require_read_access
from services.eval_api.errors import ApiError
from services.eval_api.pages import plots, reads, tables
from services.eval_api.planning import current_definitions, suites_by_name
from services.eval_api.schemas import MAX_ID, InferenceSettings
from services.eval_api.settings import ApiSettings
from services.store import comparisons, queries
from services.store.aggregates import unranked_reason
from services.store.models import Episode, Evaluation
from services.store.statuses import HARNESS_FAILURES, TERMINAL_EPISODE_STATUSES

UI_ROOT = "/ui/"
LEADERBOARD_LIMIT = 1000  # rows on the leaderboard page (the JSON API's own cap)
# Rows shown at first; the others are in the page but hidden until "show all": a browser styles and
# lays out a 1,000-row table in ~3× the time of a 100-row one (bench/page_load.py).
LEADERBOARD_FIRST_ROWS = 100
EPISODES_PER_PAGE = 500  # rows of the episodes table; `?after=INDEX` pages on
POLICY_EVALUATIONS_LIMIT = 500  # newest evaluations on a policy's page
POLL_MS = 2000  # live progress: how often a running evaluation's page asks GET /evaluations/{id}
REFRESH_MS = 10_000  # and at most how often it re-renders its charts and table (when episodes finished)

router = APIRouter(include_in_schema=False)


templates = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True,
                        trim_blocks=True, lstrip_blocks=True, auto_reload=False)
templates.filters.update(pct=tables.pct, when=tables.when, num=tables.num, ms=tables.ms)
templates.globals.update(interval_bar=plots.interval_bar, ui_root=UI_ROOT)


def render(name: str, status_code: int = 200, headers: dict[str, str] | None = None, **context: Any) -> HTMLResponse:
    """Render template ``name`` into an HTML response."""
    return HTMLResponse(templates.get_template(name).render(**context), status_code=status_code, headers=headers)


def _message(status_code: int, heading: str, message: str, hint: str = "",
             headers: dict[str, str] | None = None) -> HTMLResponse:
    return render("message.html", status_code, headers, heading=heading, message=message, hint=hint)


def _refused(session: Session, settings: ApiSettings, credentials: Any) -> HTMLResponse | None:
    """The API's read-access rule, answered in HTML: None when the request may read."""
    try:
        require_read_access(session, settings, credentials)
    except ApiError as exc:
        return _message(exc.status, "API key needed" if exc.status == 401 else "API key refused", exc.message,
                        "This server sets EVALFORGE_READS_NEED_KEY, so its pages need a key too, and a browser "
                        "cannot send one by itself: open the pages through a proxy that adds "
                        "`Authorization: Bearer <key>`, or read the JSON API (/docs) with that header.",
                        exc.headers)
    return None


@router.get("/")
def root() -> RedirectResponse:
    """The leaderboard page."""
    return RedirectResponse(UI_ROOT, status_code=307)


@router.get(UI_ROOT, response_class=HTMLResponse)
def leaderboard_page(session: SessionDep, settings: SettingsDep, credentials: Credentials,
                     suite: Annotated[str | None, Query(max_length=200)] = None,
                     include_nonstandard: bool = False) -> HTMLResponse:
    """Suites as tabs (those with results first, by name) and the chosen suite's leaderboard."""
    if (refusal := _refused(session, settings, credentials)) is not None:
        return refusal
    catalogue = {name: entry for name, entry in suites_by_name().items() if get_suite(name).leaderboard}
    # Only each suite's current definition is ranked (older versions: GET /leaderboard?definition=HASH).
    definitions = current_definitions()
    counts = queries.ranked_policy_counts(session, include_nonstandard=include_nonstandard,
                                          current_definitions=definitions)
    ranked = sorted((name, count) for name, count in counts.items() if name in catalogue)
    unranked = sorted(name for name in catalogue if name not in counts)
    suite = suite or None  # `?suite=` is no suite
    if suite is None and ranked:
        suite = max(ranked, key=lambda item: item[1])[0]  # the busiest suite first
    if suite is not None and suite not in catalogue:
        return _message(404, "Unknown suite", f"There is no suite named {suite!r}.",
                        "The leaderboard page lists every suite; GET /suites lists them as JSON.")
    entries = (queries.leaderboard(session, suite, include_nonstandard=include_nonstandard,
                                   definition_hash=definitions[suite], limit=LEADERBOARD_LIMIT + 1)
               if suite else [])
    shown = entries[:LEADERBOARD_LIMIT]
    return render("leaderboard.html", suite=catalogue.get(suite) if suite else None, ranked_suites=ranked,
                  unranked_suites=unranked, entries=shown, first_rows=LEADERBOARD_FIRST_ROWS,
                  rows=tables.leaderboard_rows(shown[:LEADERBOARD_FIRST_ROWS], UI_ROOT),
                  more_rows=tables.leaderboard_rows(shown[LEADERBOARD_FIRST_ROWS:], UI_ROOT),
                  truncated=len(entries) > LEADERBOARD_LIMIT, include_nonstandard=include_nonstandard)


@router.get(UI_ROOT + "episodes/{episode_id}/replay.gif", response_class=FileResponse)
def replay_gif(episode_id: Annotated[int, PathParam(ge=1, le=MAX_ID)], session: SessionDep,
               settings: SettingsDep, credentials: Credentials) -> Response:
    """An episode's replay GIF, from ``ARTIFACT_ROOT`` (the path its row records, never outside the root)."""
    if (refusal := _refused(session, settings, credentials)) is not None:
        return refusal
    episode = session.get(Episode, episode_id)
    relative = episode.artifact_path if episode is not None else None
    root = settings.artifact_root.resolve()
    path = (root / relative).resolve() if relative else None
    if path is None or not path.is_relative_to(root) or not path.is_file():
        where = f"{relative!r} under ARTIFACT_ROOT {str(root)!r}" if relative else "none recorded"
        return _message(404, "No replay", f"Episode {episode_id} has no replay GIF here ({where}).",
                        "Workers record the first EVALFORGE_REPLAY_EPISODES episodes of each evaluation; the "
                        "API's ARTIFACT_ROOT must name the same directory (volume) as the workers'.")
    return FileResponse(path, media_type="image/gif", headers={"Cache-Control": "max-age=86400"})


@router.get(UI_ROOT + "evaluations/{evaluation_id}", response_class=HTMLResponse)
def evaluation_page(evaluation_id: Annotated[int, PathParam(ge=1, le=MAX_ID)], session: SessionDep,
                    settings: SettingsDep, credentials: Credentials,
                    after: Annotated[int | None, Query(ge=-1, le=2**31)] = None) -> HTMLResponse:
    """Status and live progress, per-task success, the latency histogram, and the episodes."""
    if (refusal := _refused(session, settings, credentials)) is not None:
        return refusal
    evaluation = queries.get_evaluation(session, evaluation_id)
    if evaluation is None:
        return _message(404, "No such evaluation", f"There is no evaluation with id {evaluation_id}.",
                        "The leaderboard and the policy pages link to evaluations; GET /evaluations lists them.")
    results = queries.evaluation_results(session, evaluation)
    counts = results["counts"]
    rows = [plots.IntervalRow(label=t["task"], rate=t["success_rate"], low=(t["ci95"] or {}).get("low"),
                              high=(t["ci95"] or {}).get("high"), n=t["scored"]) for t in results["per_task"]]
    latencies = reads.episode_latencies_ms(session, evaluation_id)
    latency = results["overall"]["latency_ms"] or {}
    episodes = queries.list_episodes(session, evaluation_id, after_index=after, limit=EPISODES_PER_PAGE + 1)
    more = len(episodes) > EPISODES_PER_PAGE
    episodes = episodes[:EPISODES_PER_PAGE]
    task_chart = plots.interval_chart(rows, title="success rate per task with 95% intervals")
    latency_chart = plots.histogram(latencies, unit="ms", count_label="episodes",
                                    markers={"p50": latency.get("p50"), "p95": latency.get("p95")},
                                    title="histogram of per-episode mean policy latency")
    return render(
        "evaluation.html", evaluation=evaluation, results=results,
        inference_label=InferenceSettings.model_validate(evaluation.inference).label if evaluation.inference else None,
        unranked_reason=unranked_reason(results["overall"]) if evaluation.finished_at is not None else None,
        harness_failures=[reason.value for reason in HARNESS_FAILURES],
        done=sum(counts[status.value] for status in TERMINAL_EPISODE_STATUSES), live=evaluation.finished_at is None,
        poll_ms=POLL_MS, refresh_ms=REFRESH_MS, task_chart=task_chart, latency_chart=latency_chart,
        latency_count=len(latencies), episodes=episodes, after=after, page_size=EPISODES_PER_PAGE,
        episode_rows=tables.episode_rows(episodes, UI_ROOT),
        next_after=episodes[-1].episode_index if more else None)


def _over_time(evaluations: list[Evaluation]) -> list[plots.Series]:
    by_suite: dict[str, list[plots.Point]] = {}
    for e in evaluations:
        if e.success_rate is None or e.finished_at is None:
            continue
        by_suite.setdefault(e.suite, []).append(plots.Point(
            when=e.finished_at, value=e.success_rate, low=e.success_ci_low, high=e.success_ci_high,
            href=f"{UI_ROOT}evaluations/{e.id}", note=f"evaluation #{e.id}, {e.episodes_scored} episodes"))
    return [plots.Series(name=suite, points=points) for suite, points in sorted(by_suite.items())]


@router.get(UI_ROOT + "policies/{policy_id}", response_class=HTMLResponse)
def policy_page(policy_id: Annotated[int, PathParam(ge=1, le=MAX_ID)], session: SessionDep,
                settings: SettingsDep, credentials: Credentials) -> HTMLResponse:
    """The policy's metadata, its success rate per suite over time, and its evaluations."""
    if (refusal := _refused(session, settings, credentials)) is not None:
        return refusal
    policy = queries.get_policy(session, policy_id)
    if policy is None:
        return _message(404, "No such policy", f"There is no policy with id {policy_id}.",
                        "The leaderboard links to every ranked policy; GET /policies lists them all.")
    evaluations = queries.list_evaluations(session, policy_id=policy_id, limit=POLICY_EVALUATIONS_LIMIT + 1)
    shown = evaluations[:POLICY_EVALUATIONS_LIMIT]
    return render("policy.html", policy=policy, evaluations=shown, truncated=len(evaluations) > len(shown),
                  over_time=plots.line_chart(_over_time(shown), title="success rate per suite over time"))


@router.get(UI_ROOT + "comparisons", response_class=HTMLResponse)
def comparison_page(session: SessionDep, settings: SettingsDep, credentials: Credentials,
                    baseline: Annotated[int, Query(ge=1, le=MAX_ID)],
                    candidate: Annotated[int, Query(ge=1, le=MAX_ID)]) -> HTMLResponse:
    """The verdict in words, per-task differences with their intervals, and the discordant episodes
    with both replays side by side (``GET /comparisons`` as a page)."""
    if (refusal := _refused(session, settings, credentials)) is not None:
        return refusal
    try:
        comparison = comparisons.compare_evaluations(session, baseline, candidate)
    except queries.NotFound as exc:
        return _message(404, "No such evaluation", f"{str(exc)[0].upper()}{str(exc)[1:]}.",
                        "The leaderboard and the policy pages link to evaluations; GET /evaluations lists them.")
    except comparisons.NotComparable as exc:
        return _message(422, "Not comparable", f"Evaluations {baseline} and {candidate} ran different "
                        f"protocols: {'; '.join(exc.differences)}.",
                        "Episodes pair by task and seed only between evaluations of the same suite, tasks, seeds, "
                        "step limits, cameras and inference settings; submit the candidate with the baseline's.")
    rows = [comparison.overall, *comparison.per_task]
    chart = plots.difference_chart(
        [plots.DifferenceRow(label=row.task or "overall", difference=row.difference,
                             low=row.ci95[0] if row.ci95 else None, high=row.ci95[1] if row.ci95 else None,
                             n=row.pairs) for row in rows],
        title="difference in success rate (candidate − baseline, points) per task with 95% intervals")
    return render("comparison.html", comparison=comparison, rows=rows, chart=chart,
                  format_p=comparisons.format_p, alpha=comparisons.ALPHA)
