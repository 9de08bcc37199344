"""``/leaderboard``: policies ranked per suite on their comparable evaluations pooled, one suite definition at a time.

Each entry pools the scored episodes of a policy's finished standard evaluations under one
definition and one set of inference settings (``queries.leaderboard``; why pooling:
docs/statistics.md, "Leaderboard"), and says whether it differs significantly from the entry above.

Evaluations are comparable only under the same suite definition (``Suite.definition_hash``):
the board ranks those made under the suite's current one, and ``?definition=HASH`` shows an
older version's board. Evaluations made before definitions were recorded are on none.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from benchmarks.registry import get_suite
from services.eval_api.deps import ReadAccessDep, SessionDep
from services.eval_api.errors import ApiError
from services.eval_api.planning import current_definitions, get_suite_entry
from services.eval_api.schemas import (
    DifferenceFromAbove,
    Interval,
    LeaderboardEntryOut,
    LeaderboardOut,
    Name,
    PolicyRef,
    error_responses,
)
from services.store import queries

router = APIRouter(tags=["leaderboard"])


@router.get("/leaderboard", response_model=LeaderboardOut, responses=error_responses(401, 403, 404, 422))
def leaderboard(suite: Annotated[Name, Query(description="Suite name (`GET /suites`).",
                                                          examples=["metaworld-mt10"])], session: SessionDep,
                _read: ReadAccessDep,
                include_nonstandard: Annotated[bool, Query(
                    description="Also rank evaluations of a task subset or with lowered step limits.")] = False,
                definition: Annotated[str | None, Query(pattern=r"^[0-9a-f]{64}$", description=(
                    "A suite definition hash (an evaluation's `protocol.definition_hash`): that version's board; "
                    "default: the suite's current definition."))] = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> LeaderboardOut:
    """Each policy's finished evaluations on `suite` under one suite definition (default: the current
    one) pooled: pooled success rate first, ties to more episodes, then to the earlier result. Each
    entry lists the evaluations pooled and whether it is significantly different from the entry
    above (paired on shared (task, seed) episodes, else unpaired Newcombe)."""
    get_suite_entry(suite)  # 422 for an unknown suite, naming close matches
    if not get_suite(suite).leaderboard:
        raise ApiError(404, "not_ranked", f"suite {suite} measures the service's plumbing (docs/suites.md) and has "
                       "no leaderboard; its evaluations are read at GET /evaluations/{id}")
    current = current_definitions()[suite]
    definition_hash = definition or current
    entries = queries.leaderboard(session, suite, definition_hash=definition_hash,
                                  include_nonstandard=include_nonstandard, limit=limit)
    if not entries and definition_hash != current and not queries.has_definition(session, suite, definition_hash):
        raise ApiError(404, "unknown_definition",
                       f"no evaluation of suite {suite} was made under definition {definition_hash}; its current "
                       f"definition is {current} (leave `definition` out for it), and an evaluation's own is its "
                       "`protocol.definition_hash`", {"current_definition": current})
    return LeaderboardOut(suite=suite, definition_hash=definition_hash, current_definition=definition_hash == current,
                          include_nonstandard=include_nonstandard, entries=[
        LeaderboardEntryOut(rank=e.rank, policy=PolicyRef.model_validate(e.policy),
                            evaluation_id=e.evaluation_ids[-1], evaluation_ids=e.evaluation_ids,
                            success_rate=e.success_rate, ci95=Interval(low=e.ci_low, high=e.ci_high),
                            episodes=e.episodes, successes=e.successes, finished_at=e.finished_at,
                            inference=e.inference or {}, not_different_from_above=e.not_different_from_above,
                            difference_from_above=_difference(e.versus_above))
        for e in entries])


def _difference(versus_above: queries.NeighbourDifference | None) -> DifferenceFromAbove | None:
    if versus_above is None:
        return None
    return DifferenceFromAbove(difference=versus_above.difference,
                               ci95=Interval(low=versus_above.ci_low, high=versus_above.ci_high),
                               method=versus_above.method, pairs=versus_above.pairs, p_value=versus_above.p_value)
