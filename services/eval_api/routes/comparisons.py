"""``/comparisons``: the paired comparison of two evaluations of the same protocol.

The figures are ``services.store.comparisons``' (episodes paired by task and seed,
Newcombe's paired interval, the exact McNemar test); this module only reads them out.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from services.eval_api.deps import ReadAccessDep, SessionDep
from services.eval_api.errors import ApiError
from services.eval_api.schemas import (
    MAX_ID,
    ComparisonOut,
    ComparisonRow,
    ComparisonSide,
    DiscordantPair,
    EvaluationOut,
    Interval,
    UnpairedEpisode,
    error_responses,
)
from services.store import comparisons
from services.store.models import Evaluation
from services.store.queries import NotFound

router = APIRouter(tags=["comparisons"])

INTERVAL_METHOD = "Newcombe (1998) method 10 for paired proportions (Stat Med 17:2635-2650), 95%"
TEST_METHOD = "exact McNemar: two-sided binomial test of c out of b + c discordant pairs at 1/2"


def comparison_row(result: comparisons.PairedResult) -> ComparisonRow:
    ci = result.ci95
    return ComparisonRow(task=result.task, pairs=result.pairs, baseline_rate=result.baseline_rate,
                         candidate_rate=result.candidate_rate, difference=result.difference,
                         ci95=Interval(low=ci[0], high=ci[1]) if ci else None, p_value=result.p_value,
                         both_succeeded=result.table.a, baseline_only=result.table.b,
                         candidate_only=result.table.c, both_failed=result.table.d)


def comparison_out(comparison: comparisons.Comparison) -> ComparisonOut:
    """The API body of a comparison."""

    def side(evaluation: Evaluation, counts: comparisons.SideCounts) -> ComparisonSide:
        return ComparisonSide(evaluation=EvaluationOut.model_validate(evaluation), scored=counts.scored,
                              harness_failures=counts.harness_failures, cancelled=counts.cancelled,
                              unfinished=counts.unfinished)

    return ComparisonOut(
        baseline=side(comparison.baseline, comparison.baseline_counts),
        candidate=side(comparison.candidate, comparison.candidate_counts),
        live=comparison.live, verdict=comparison.verdict, alpha=comparisons.ALPHA,
        interval_method=INTERVAL_METHOD, test_method=TEST_METHOD,
        overall=comparison_row(comparison.overall), per_task=[comparison_row(row) for row in comparison.per_task],
        unpaired=[UnpairedEpisode(task=u.task, seed=u.seed, side=u.side, episode_id=u.episode_id, reason=u.reason)
                  for u in comparison.unpaired],
        unpaired_total=comparison.unpaired_total,
        discordant=[DiscordantPair(task=p.task, seed=p.seed, succeeded=p.succeeded,
                                   baseline_episode_id=p.baseline_episode_id,
                                   candidate_episode_id=p.candidate_episode_id,
                                   baseline_artifact_path=p.baseline_artifact_path,
                                   candidate_artifact_path=p.candidate_artifact_path)
                    for p in comparison.discordant],
        discordant_total=comparison.overall.table.b + comparison.overall.table.c)


@router.get("/comparisons", response_model=ComparisonOut, responses=error_responses(401, 403, 404, 422))
def compare(baseline: Annotated[int, Query(ge=1, le=MAX_ID, description="The baseline evaluation's id.")],
            candidate: Annotated[int, Query(ge=1, le=MAX_ID, description="The candidate evaluation's id.")],
            session: SessionDep, _read: ReadAccessDep) -> ComparisonOut:
    """Pair the two evaluations' episodes by (task, seed) and compare them, per task and overall: both
    success rates, the difference candidate − baseline with Newcombe's paired 95% interval, the exact
    McNemar p-value and the discordant counts b (only the baseline succeeded) and c (only the candidate).

    Episodes that are not scored on both sides (harness failures, cancelled, unfinished) are left out of
    both; the unpaired ones are listed and the harness failures counted per side. Evaluations whose
    protocols differ are a 422 (`not_comparable`) naming what differs; either may still be running
    (`live: true`)."""
    try:
        comparison = comparisons.compare_evaluations(session, baseline, candidate)
    except NotFound as exc:
        raise ApiError(404, "not_found", f"{exc}; GET /evaluations lists them") from exc
    except comparisons.NotComparable as exc:
        raise ApiError(422, "not_comparable", str(exc), {"differences": exc.differences}) from exc
    return comparison_out(comparison)
