"""A typed Python client of the EvalForge evaluation API: only the client, no rendering.

    from services.client import EvalForgeClient

    with EvalForgeClient() as api:             # EVALFORGE_API_URL, EVALFORGE_API_KEY
        policy = api.register_policy("bc", "ws://gpu-3:8000/ws")
        evaluation = api.submit_evaluation(policy.id, "metaworld-mt10", episodes_per_task=10)
        report = api.watch_evaluation(evaluation.id)   # polls until it is done
        print(report.overall.success_rate, report.overall.ci95)   # an EvaluationDetail

It speaks plain HTTP/JSON (``httpx``) and imports no FastAPI and no SQLAlchemy,
so scripts, notebooks and the ``evalforge eval …`` verbs stay light. Answers are
the API's own response bodies, parsed from its JSON with the classes the server
declares them with (``services/eval_api/schemas.py``, pydantic only):
``PolicyOut``, ``EvaluationOut`` (listings), ``EvaluationDetail``, ``EpisodeOut``,
``LeaderboardOut``, ``SuiteOut``. Tables and progress bars are the command line's
(``services/cli/render.py``). Every failure is an ``ApiRequestError`` carrying
the HTTP status, the API's stable error ``code`` and its ``message`` (which names
the fix); an API that does not answer is an ``ApiUnreachable``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import httpx

# The API's own response bodies: the client returns what the server declares, defined once.
from services.eval_api.schemas import (
    ComparisonOut,
    EpisodeOut,
    EvaluationDetail,
    EvaluationOut,
    LeaderboardOut,
    PolicyOut,
    PolicySummary,
    SuiteOut,
)

DEFAULT_API_URL = "http://127.0.0.1:8080"
API_URL_ENV = "EVALFORGE_API_URL"
API_KEY_ENV = "EVALFORGE_API_KEY"

_EVALUATION_FILTERS = frozenset({"policy_id", "suite", "status", "tag"})


# ---------------------------------------------------------------------------- errors


class ApiRequestError(Exception):
    """A request to the API failed: HTTP ``status``, the API's stable ``code``, its ``message``.

    ``status`` is None when no answer came back (see ``ApiUnreachable``) or when the
    client itself found the problem before asking (e.g. an unknown policy name).
    """

    def __init__(self, status: int | None, code: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    def __str__(self) -> str:
        if self.status is None:
            return self.message
        return f"{self.message} (HTTP {self.status} {self.code})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiRequestError:
        """The error of a 4xx/5xx answer: the API's ``{"error": {...}}`` body, or the raw text."""
        try:
            error = response.json()["error"]
            return cls(response.status_code, str(error["code"]), str(error["message"]), error.get("details"))
        except (ValueError, KeyError, TypeError):
            text = " ".join(response.text.split())[:300] or response.reason_phrase
            return cls(response.status_code, f"http_{response.status_code}",
                       f"{response.request.method} {response.request.url} answered HTTP {response.status_code}: "
                       f"{text} (is {response.request.url.host}:{response.request.url.port} an EvalForge API?)")


class ApiUnreachable(ApiRequestError):
    """No HTTP answer at all: nothing listens at the URL, a timeout, a network error."""

    def __init__(self, api_url: str, reason: str) -> None:
        super().__init__(None, "unreachable", f"cannot reach the EvalForge API at {api_url}: {reason} — start it "
                         f"with `evalforge up` or set --api-url/{API_URL_ENV}")
        self.api_url = api_url


class WatchTimeout(TimeoutError):
    """``watch_evaluation`` gave up waiting; the evaluation itself goes on. ``report`` is the last seen."""

    def __init__(self, report: EvaluationDetail, timeout_s: float) -> None:
        super().__init__(f"evaluation {report.id} is still {report.status} after {timeout_s:g} s "
                         f"({report.episodes_done}/{report.episodes_total} episodes done); it goes on on the "
                         f"server: follow it with `evalforge eval status {report.id} --watch`")
        self.report = report


class EvalForgeClient:
    """The evaluation API over HTTP. Use as a context manager (or call ``close()``) to free its connections.

    ``api_url`` defaults to ``$EVALFORGE_API_URL``, else ``http://127.0.0.1:8080``;
    ``api_key`` to ``$EVALFORGE_API_KEY`` (writes need one; reads only when the
    server sets ``EVALFORGE_READS_NEED_KEY``). ``timeout_s`` bounds each request.
    Listings are fetched ``page_size`` rows per request, following the API's cursors.
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, timeout_s: float = 10.0, *,
                 page_size: int = 100) -> None:
        url = (api_url or os.environ.get(API_URL_ENV) or DEFAULT_API_URL).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"API URL {url!r} is not an http(s) URL; pass one like {DEFAULT_API_URL} "
                             f"(--api-url or {API_URL_ENV})")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.api_url = url
        self.api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        self.timeout_s = timeout_s
        self.page_size = page_size
        headers = {"User-Agent": "evalforge-client", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> EvalForgeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ transport

    def _request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                 json: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, params=params, json=json, headers=headers)
        except httpx.TimeoutException as exc:
            raise ApiUnreachable(self.api_url, f"no answer within {self.timeout_s:g} s "
                                 f"({method} {path})") from exc
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.api_url, str(exc) or type(exc).__name__) from exc
        if response.is_error:
            error = ApiRequestError.from_response(response)
            if response.status_code == 401 and not self.api_key:
                error.message += f"; this client sent no key: pass --api-key KEY or set {API_KEY_ENV}"
            raise error
        return response

    def _get(self, path: str, **params: Any) -> Any:
        return self._request("GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    def _pages(self, path: str, params: dict[str, Any], limit: int | None = None) -> Iterator[dict[str, Any]]:
        """The items of a paged listing, following ``next_cursor``, at most ``limit`` of them."""
        cursor, returned = None, 0
        while True:
            size = self.page_size if limit is None else min(self.page_size, limit - returned)
            page = self._get(path, **params, cursor=cursor, limit=size)
            for item in page["items"]:
                yield item
                returned += 1
            cursor = page.get("next_cursor")
            if cursor is None or (limit is not None and returned >= limit):
                return

    # ------------------------------------------------------------------ policies

    def register_policy(self, name: str, endpoint: str, version: str | None = None, *,
                        replicas: list[str] | None = None) -> PolicyOut:
        """Register the policy server at ``endpoint`` (the API reads its handshake), with ``replicas``:
        more servers of the same checkpoint (each must answer the same handshake, else 409).

        Idempotent: registering the same name and version of the same checkpoint again
        returns the existing policy (the API answers 200 and updates its endpoint). The
        same name and version with another checkpoint is an ``ApiRequestError`` 409
        ``policy_version_exists``: pass another ``version``.
        """
        body: dict[str, Any] = {"name": name, "endpoint": endpoint}
        if version is not None:
            body["version"] = version
        if replicas:
            body["replicas"] = list(replicas)
        return PolicyOut.model_validate(self._request("POST", "/policies", json=body).json())

    def add_policy_endpoint(self, policy_id: int, endpoint: str) -> PolicyOut:
        """Add a replica of policy ``policy_id`` at ``endpoint`` (its handshake must name the policy's
        checkpoint: ``ApiRequestError`` 409 ``replica_mismatch`` otherwise)."""
        return PolicyOut.model_validate(
            self._request("POST", f"/policies/{policy_id}/endpoints", json={"endpoint": endpoint}).json())

    def remove_policy_endpoint(self, policy_id: int, endpoint: str) -> PolicyOut:
        """Remove replica ``endpoint`` of policy ``policy_id`` (its first endpoint cannot be removed)."""
        return PolicyOut.model_validate(
            self._request("DELETE", f"/policies/{policy_id}/endpoints", params={"endpoint": endpoint}).json())

    def get_policy(self, policy_id: int) -> PolicyOut:
        return PolicyOut.model_validate(self._get(f"/policies/{policy_id}"))

    def list_policies(self) -> list[PolicySummary]:
        """Every registered policy, newest first (without task lists: ``get_policy`` has them)."""
        return [PolicySummary.model_validate(item) for item in self._pages("/policies", {})]

    def resolve_policy(self, ref: str | int) -> PolicyOut:
        """The policy that ``ref`` names: an id, a ``name`` (with one version) or ``name:version``."""
        text = str(ref).strip()
        if text.isdigit():
            return self.get_policy(int(text))
        policies = self.list_policies()
        matches = [p for p in policies if p.name == text]
        if not matches and ":" in text:
            name, _, version = text.rpartition(":")
            matches = [p for p in policies if p.name == name and p.version == version]
        if len(matches) == 1:
            return self.get_policy(matches[0].id)
        if matches:
            versions = ", ".join(f"{p.label} (id {p.id})" for p in matches)
            raise ApiRequestError(None, "ambiguous_policy", f"policy {text!r} has {len(matches)} versions: "
                                  f"{versions}; name one as NAME:VERSION or by id")
        known = ", ".join(sorted({p.label for p in policies})[:10]) or "none yet"
        raise ApiRequestError(None, "unknown_policy", f"no policy named {text!r} is registered at {self.api_url} "
                              f"(registered: {known}); register it with `evalforge policy register --name NAME "
                              "--endpoint ws://HOST:PORT/ws`, or pass an id from `evalforge policy list`")

    # ------------------------------------------------------------------ evaluations

    def submit_evaluation(self, policy_id: int, suite: str, episodes_per_task: int, *, seed: int = 0,
                          tasks: list[str] | None = None, max_steps: int | None = None,
                          tags: list[str] | None = None, idempotency_key: str | None = None,
                          cameras: dict[str, tuple[int, int]] | None = None,
                          inference: dict[str, Any] | None = None, record: str | None = None) -> EvaluationDetail:
        """Start an evaluation; returns its report (status ``pending``).

        ``cameras`` (``{camera: (height, width)}``) overrides the cameras the policy asks for;
        ``inference`` sets ``action_horizon`` or ``temporal_ensemble`` (default: whole chunks);
        ``record`` (``none``, ``first``, ``failures``, ``all``) which episodes to record as a dataset.

        With ``idempotency_key``, a retry of the same request returns the same evaluation
        instead of starting a second one.
        """
        body: dict[str, Any] = {"policy_id": policy_id, "suite": suite, "episodes_per_task": episodes_per_task,
                                "seed": seed}
        if tasks is not None:
            body["tasks"] = list(tasks)
        if max_steps is not None:
            body["max_steps"] = max_steps
        if tags is not None:
            body["tags"] = list(tags)
        if cameras is not None:
            body["cameras"] = {name: list(size) for name, size in cameras.items()}
        if inference:
            body["inference"] = dict(inference)
        if record is not None and record != "none":
            body["record"] = record
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        return EvaluationDetail.model_validate(
            self._request("POST", "/evaluations", json=body, headers=headers).json())

    def get_evaluation(self, evaluation_id: int) -> EvaluationDetail:
        """Status, episode counts by status, per-task and overall results."""
        return EvaluationDetail.model_validate(self._get(f"/evaluations/{evaluation_id}"))

    def list_evaluations(self, *, limit: int | None = 50, **filters: Any) -> list[EvaluationOut]:
        """Evaluations, newest first; ``filters``: ``policy_id``, ``suite``, ``status``, ``tag``.
        ``limit=None`` returns all of them."""
        unknown = sorted(set(filters) - _EVALUATION_FILTERS)
        if unknown:
            raise TypeError(f"list_evaluations() got unknown filters {unknown}; "
                            f"use {sorted(_EVALUATION_FILTERS)}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1 (or None for all), got {limit}")
        params = {k: v for k, v in filters.items() if v is not None}
        return [EvaluationOut.model_validate(item) for item in self._pages("/evaluations", params, limit)]

    def episodes(self, evaluation_id: int) -> list[EpisodeOut]:
        """Every episode of an evaluation, in index order."""
        return [EpisodeOut.model_validate(item)
                for item in self._pages(f"/evaluations/{evaluation_id}/episodes", {})]

    def export_episodes(self, evaluation_id: int, format: str, out: BinaryIO) -> int:
        """Stream every episode of an evaluation, with its provenance, to the binary file ``out``
        as ``format`` (``csv`` or ``jsonl``; services/eval_api/exports.py describes the columns),
        chunk by chunk as the API sends it, never holding it all; returns the bytes written."""
        return self._download(f"/evaluations/{evaluation_id}/episodes", {"format": format}, out)

    def download_dataset(self, evaluation_id: int, out: BinaryIO, *, timeout_s: float | None = None) -> int:
        """Stream an evaluation's recorded episodes, a LeRobot v3 dataset in an uncompressed tar, to the
        binary file ``out``; returns the bytes written (404 ``no_recordings`` when none were recorded).
        The API builds the dataset before its first byte: ``timeout_s`` (default: the client's) bounds
        each wait."""
        return self._download(f"/evaluations/{evaluation_id}/dataset", {}, out, timeout_s=timeout_s)

    def _download(self, path: str, params: dict[str, Any], out: BinaryIO, *, timeout_s: float | None = None) -> int:
        written = 0
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if response.is_error:
                    response.read()
                    raise ApiRequestError.from_response(response)
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
        except httpx.TimeoutException as exc:
            raise ApiUnreachable(self.api_url, f"no answer within {timeout_s or self.timeout_s:g} s (GET {path})") \
                from exc
        except httpx.TransportError as exc:
            raise ApiUnreachable(self.api_url, str(exc) or type(exc).__name__) from exc
        return written

    def cancel_evaluation(self, evaluation_id: int) -> EvaluationDetail:
        """Cancel: pending episodes are dropped, running ones finish. A finished evaluation is a 409."""
        return EvaluationDetail.model_validate(self._request("POST", f"/evaluations/{evaluation_id}/cancel").json())

    def watch_evaluation(self, evaluation_id: int, *, poll_s: float = 1.0, timeout_s: float | None = None,
                         on_report: Callable[[EvaluationDetail], None] | None = None) -> EvaluationDetail:
        """Poll until the evaluation is finished, cancelled or failed; return its final report.

        ``on_report`` sees every report polled, the first and the last included (the
        command line draws its progress bar with it). ``WatchTimeout`` after
        ``timeout_s`` (default: wait as long as it takes).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        report = self.get_evaluation(evaluation_id)
        while True:
            if on_report is not None:
                on_report(report)
            if report.done:
                return report
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WatchTimeout(report, timeout_s or 0.0)
                time.sleep(min(poll_s, left))
            else:
                time.sleep(poll_s)
            report = self.get_evaluation(evaluation_id)

    def compare(self, baseline_id: int, candidate_id: int) -> ComparisonOut:
        """The paired comparison of two evaluations of the same protocol (``GET /comparisons``): per task
        and overall, both success rates, the difference with its 95% interval, McNemar's p, the verdict."""
        return ComparisonOut.model_validate(self._get("/comparisons", baseline=baseline_id, candidate=candidate_id))

    # ------------------------------------------------------------------ leaderboard, catalogue, health

    def leaderboard(self, suite: str, *, include_nonstandard: bool = False, limit: int | None = None
                    ) -> LeaderboardOut:
        """Each policy's best finished evaluation on ``suite``, ranked."""
        return LeaderboardOut.model_validate(self._get("/leaderboard", suite=suite,
                                                    include_nonstandard=str(include_nonstandard).lower(),
                                                    limit=limit))

    def suites(self) -> list[SuiteOut]:
        """The benchmark suites an evaluation can run (tasks, dimensions, step limits)."""
        return [SuiteOut.model_validate(item) for item in self._get("/suites")]

    def wait_ready(self, timeout_s: float) -> None:
        """Return once ``GET /readyz`` says ready (database and broker up); ``ApiUnreachable``
        naming what was still wrong after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = self._http.get("/readyz", timeout=min(self.timeout_s, max(timeout_s, 0.1)))
                if response.status_code == 200:
                    return
                try:
                    checks = response.json().get("checks", {})
                    problem = "not ready: " + "; ".join(f"{k} {v}" for k, v in checks.items() if v != "ok")
                except (ValueError, AttributeError):
                    problem = f"GET /readyz answered HTTP {response.status_code}"
            except httpx.TransportError as exc:
                problem = str(exc) or type(exc).__name__
            if time.monotonic() >= deadline:
                raise ApiUnreachable(self.api_url, f"not ready within {timeout_s:g} s ({problem})")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
