"""``/suites``: the benchmark catalogue — tasks, dimensions, step limits (no simulator needed)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from services.eval_api.deps import ReadAccessDep
from services.eval_api.errors import ApiError
from services.eval_api.planning import suites_by_name
from services.eval_api.schemas import SuiteOut, error_responses

router = APIRouter(prefix="/suites", tags=["suites"])


@router.get("", response_model=list[SuiteOut], responses=error_responses(401, 403))
def list_suites(_read: ReadAccessDep) -> list[dict[str, Any]]:
    """Every benchmark suite an evaluation can run."""
    return list(suites_by_name().values())


@router.get("/{suite}", response_model=SuiteOut, responses=error_responses(401, 403, 404))
def get_suite(suite: Annotated[str, Path(max_length=200)], _read: ReadAccessDep) -> dict[str, Any]:
    """One suite."""
    try:
        return suites_by_name()[suite]
    except KeyError:
        raise ApiError(404, "not_found", f"no suite named {suite!r}; GET /suites lists them") from None
