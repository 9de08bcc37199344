"""The evaluation API as a FastAPI app: ``create_app()`` wires settings, store, queue and routes.

    uvicorn --factory services.eval_api.app:create_app      # or: evalforge api

JSON everywhere (errors too, see ``errors``), OpenAPI at ``/docs`` and
``/openapi.json``; HTML pages for people under ``/ui/``, ``/`` redirecting there
(``pages``). Everything a request needs hangs off ``app.state`` — the
session factory, the episode queue, the handshake reader, the metrics — so tests
build apps against their own database and fakes without patching modules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import Engine

from services.eval_api.errors import install_error_handlers
from services.eval_api.handshake import read_handshake
from services.eval_api.metrics import ApiMetrics, RequestMetrics
from services.eval_api.middleware import BodySizeLimit
from services.eval_api.pages import router as pages_router
from services.eval_api.routes import (
    comparisons,
    evaluations,
    health,
    leaderboard,
    policies,
    suites,
    workers,
)
from services.eval_api.settings import ApiSettings
from services.eval_api.settings import settings as default_settings
from services.protocol.adapters import ServerInfo
from services.queue import CeleryEpisodeQueue, EpisodeQueue, QueueSettings
from services.store.db import create_db_engine, make_session_factory
from services.store.settings import StoreSettings

DESCRIPTION = """\
Evaluate robot policies in simulation at scale.

Register a policy server (`POST /policies`), submit an evaluation (`POST /evaluations`),
follow it (`GET /evaluations/{id}`) and compare policies (`GET /leaderboard?suite=…`).
Writes need `Authorization: Bearer <key>` (keys come from `evalforge apikey create`);
reads need one when the server sets `EVALFORGE_READS_NEED_KEY`. Errors are
`{"error": {"code", "message", "details"}}`.

Success rates count succeeded and failed episodes — including policy timeouts and
policy errors — and leave out cancelled episodes and harness failures (`env_error`,
`worker_lost`, `checkpoint_mismatch`, `endpoint_refused`, `policy_unreachable`), which are reported under
`failure_reasons`; an evaluation most of whose episodes are harness failures is not
ranked (`unranked_reason` says so). Intervals are Wilson 95%.

A store too busy to take a request answers 503 with `Retry-After`; a submission past
`EVALFORGE_MAX_QUEUED_EPISODES` queued episodes answers 429.
"""


def create_app(settings: ApiSettings | None = None, store_settings: StoreSettings | None = None, *,
               engine: Engine | None = None, episode_queue: EpisodeQueue | None = None,
               queue_settings: QueueSettings | None = None,
               handshake: Callable[..., ServerInfo] | None = None) -> FastAPI:
    """The API app. Defaults come from the environment; tests pass their engine, queue (or the queue's
    settings) or handshake."""
    settings = settings or default_settings
    owns_engine = engine is None
    engine = engine or create_db_engine(store_settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            engine.dispose()

    app = FastAPI(title="EvalForge evaluation API", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.episode_queue = episode_queue or CeleryEpisodeQueue.from_settings(queue_settings)
    app.state.read_handshake = handshake or read_handshake
    app.state.metrics = ApiMetrics()

    install_error_handlers(app)
    # Added last = outermost: metrics see every response, including the cap's 413.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    for module in (policies, evaluations, comparisons, leaderboard, suites, workers, health):
        app.include_router(module.router)
    app.include_router(pages_router)
    return app
