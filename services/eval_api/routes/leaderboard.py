"""``/leaderboard``: policies ranked per suite by their best finished evaluation."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from services.eval_api.deps import ReadAccessDep, SessionDep
from services.eval_api.planning import get_suite_entry
from services.eval_api.schemas import (
    Interval,
    LeaderboardEntryOut,
    LeaderboardOut,
    Name,
    PolicyRef,
    error_responses,
)
from services.store import queries

router = APIRouter(tags=["leaderboard"])


@router.get("/leaderboard", response_model=LeaderboardOut, responses=error_responses(401, 403, 422))
def leaderboard(suite: Annotated[Name, Query(description="Suite name (`GET /suites`).",
                                                          examples=["metaworld-mt10"])], session: SessionDep,
                _read: ReadAccessDep,
                include_nonstandard: Annotated[bool, Query(
                    description="Also rank evaluations of a task subset or with lowered step limits.")] = False,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> LeaderboardOut:
    """Each policy's best finished evaluation on `suite`: highest success rate first, ties to the
    higher Wilson lower bound (more evidence), then to the earlier result."""
    get_suite_entry(suite)
    entries = queries.leaderboard(session, suite, include_nonstandard=include_nonstandard, limit=limit)
    return LeaderboardOut(suite=suite, include_nonstandard=include_nonstandard, entries=[
        LeaderboardEntryOut(rank=e.rank, policy=PolicyRef.model_validate(e.policy), evaluation_id=e.evaluation_id,
                            success_rate=e.success_rate, ci95=Interval(low=e.ci_low, high=e.ci_high),
                            episodes=e.episodes, finished_at=e.finished_at, inference=e.inference or {})
        for e in entries])
