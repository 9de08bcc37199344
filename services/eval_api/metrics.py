"""Prometheus metrics of the evaluation API, on a registry per app (tests build many apps).

``RequestMetrics`` is an ASGI middleware that counts requests and times them by
route *template* (``/evaluations/{evaluation_id}``), never by raw path, so the
label set stays bounded whatever clients request.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ApiMetrics:
    """The API's counters and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("evalforge_api_requests_total", "HTTP requests by route template and status.",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("evalforge_api_request_duration_seconds",
                                 "Time to answer an HTTP request, by route template.", ["method", "route"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.evaluations_created = Counter("evalforge_api_evaluations_created_total",
                                           "Evaluations created (idempotent replays not counted).",
                                           registry=self.registry)
        self.episodes_enqueued = Counter("evalforge_api_episodes_enqueued_total",
                                         "Episode tasks published to the broker.", registry=self.registry)
        self.episodes_not_enqueued = Counter(
            "evalforge_api_episodes_enqueue_failed_total",
            "Episodes left pending because the broker failed (the sweeper re-enqueues them).",
            registry=self.registry)


class RequestMetrics:
    """Count and time every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], template, str(status)).inc()
            self.metrics.latency.labels(scope["method"], template).observe(time.perf_counter() - start)
