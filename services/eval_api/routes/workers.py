"""``/workers``: the live worker pools — which workers run, on which host, serving which simulators."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter

from services.eval_api.deps import ReadAccessDep, SessionDep, SettingsDep
from services.eval_api.schemas import WorkerOut, error_responses
from services.store import queries
from services.store.models import Worker, utcnow

router = APIRouter(prefix="/workers", tags=["workers"])


@router.get("", response_model=list[WorkerOut], responses=error_responses(401, 403))
def list_workers(session: SessionDep, settings: SettingsDep, _read: ReadAccessDep) -> list[Worker]:
    """Workers whose heartbeat is younger than `EVALFORGE_WORKER_TIMEOUT_S`, with the simulator families
    (and their packages' versions) each serves: one pool per family."""
    return queries.live_workers(session, seen_after=utcnow() - timedelta(seconds=settings.worker_timeout_s))
