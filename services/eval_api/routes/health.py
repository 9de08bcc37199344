"""``/healthz`` (the process answers), ``/readyz`` (database and broker reachable), ``/metrics``."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from services.eval_api.schemas import HealthOut, ReadyOut
from services.store.models import Evaluation

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, response_model_exclude_none=True)
def healthz() -> HealthOut:
    """The process is up; `instance` echoes its EVALFORGE_INSTANCE_TOKEN (when it has one)."""
    return HealthOut(status="ok", instance=os.environ.get("EVALFORGE_INSTANCE_TOKEN"))


def _check_database(request: Request) -> str:
    try:
        with request.app.state.session_factory() as session:
            # A query on a real table, so a database without the schema is "not ready" too.
            session.execute(select(Evaluation.id).limit(1)).all()
    except Exception as exc:
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return "ok"


def _check_broker(request: Request) -> str:
    try:
        request.app.state.episode_queue.ping()
    except Exception as exc:
        return f"error: {type(exc).__name__}: {str(exc)[:200]}"
    return "ok"


@router.get("/readyz", response_model=ReadyOut, responses={503: {"model": ReadyOut}})
async def readyz(request: Request) -> JSONResponse:
    """Ready to serve: the database (with its schema) and the broker answer. 503 otherwise."""
    checks = {"database": await run_in_threadpool(_check_database, request),
              "broker": await run_in_threadpool(_check_broker, request)}
    ready = all(value == "ok" for value in checks.values())
    body = ReadyOut(status="ready" if ready else "not ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(request: Request) -> Response:
    """Prometheus metrics."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
