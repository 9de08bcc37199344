"""A typed Python client of the EvalForge evaluation API, and the tables that show its answers.

    from services.client import EvalForgeClient, print_results

    with EvalForgeClient() as api:             # EVALFORGE_API_URL, EVALFORGE_API_KEY
        policy = api.register_policy("bc", "ws://gpu-3:8000/ws")
        evaluation = api.submit_evaluation(policy["id"], "metaworld-mt10", episodes_per_task=10)
        detail = api.watch_evaluation(evaluation["id"])   # a progress bar until it is done
        print_results(detail, rich.console.Console())

It speaks plain HTTP/JSON (``httpx``) and imports nothing of the server (no
FastAPI, no SQLAlchemy), so scripts, notebooks and the ``evalforge eval …`` verbs
(``services/client_cli.py``) stay light. Responses are the API's JSON as dicts,
exactly as ``GET /docs`` describes them. Every failure is an ``ApiError`` carrying
the HTTP status, the API's stable error ``code`` and its ``message`` (which names
the fix); an API that does not answer is an ``ApiUnreachable``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

DEFAULT_API_URL = "http://127.0.0.1:8080"
API_URL_ENV = "EVALFORGE_API_URL"
API_KEY_ENV = "EVALFORGE_API_KEY"

# Evaluation statuses after which nothing changes any more (services/store/models.py:EvaluationStatus).
DONE_STATUSES = frozenset({"finished", "cancelled", "failed"})
# Episode statuses, in the order a progress line shows them (EpisodeStatus).
EPISODE_STATUSES = ("pending", "running", "succeeded", "failed", "cancelled")
TERMINAL_EPISODE_STATUSES = ("succeeded", "failed", "cancelled")
_EVALUATION_FILTERS = frozenset({"policy_id", "suite", "status", "tag"})


class ApiError(Exception):
    """The API refused a request: HTTP ``status``, the API's stable ``code``, its ``message``.

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
    def from_response(cls, response: httpx.Response) -> ApiError:
        """The error of a 4xx/5xx answer: the API's ``{"error": {...}}`` body, or the raw text."""
        try:
            error = response.json()["error"]
            return cls(response.status_code, str(error["code"]), str(error["message"]), error.get("details"))
        except (ValueError, KeyError, TypeError):
            text = " ".join(response.text.split())[:300] or response.reason_phrase
            return cls(response.status_code, f"http_{response.status_code}",
                       f"{response.request.method} {response.request.url} answered HTTP {response.status_code}: "
                       f"{text} (is {response.request.url.host}:{response.request.url.port} an EvalForge API?)")


class ApiUnreachable(ApiError):
    """No HTTP answer at all: nothing listens at the URL, a timeout, a network error."""

    def __init__(self, api_url: str, reason: str) -> None:
        super().__init__(None, "unreachable", f"cannot reach the EvalForge API at {api_url}: {reason} — start it "
                         f"with `evalforge up` or set --api-url/{API_URL_ENV}")
        self.api_url = api_url


class WatchTimeout(TimeoutError):
    """``watch_evaluation`` gave up waiting; the evaluation itself goes on. ``detail`` is the last seen."""

    def __init__(self, detail: dict[str, Any], timeout_s: float) -> None:
        super().__init__(f"evaluation {detail['id']} is still {detail['status']} after {timeout_s:g} s "
                         f"({episodes_done(detail)}/{detail['episodes_total']} episodes done); it goes on on the "
                         f"server: follow it with `evalforge eval status {detail['id']} --watch`")
        self.detail = detail


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
            error = ApiError.from_response(response)
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

    def register_policy(self, name: str, endpoint: str, version: str | None = None) -> dict[str, Any]:
        """Register the policy server at ``endpoint`` (the API reads its handshake).

        Idempotent: registering the same name and version of the same checkpoint again
        returns the existing policy (the API answers 200 and updates its endpoint). The
        same name and version with another checkpoint is an ``ApiError`` 409
        ``policy_version_exists``: pass another ``version``.
        """
        body: dict[str, Any] = {"name": name, "endpoint": endpoint}
        if version is not None:
            body["version"] = version
        return self._request("POST", "/policies", json=body).json()

    def get_policy(self, policy_id: int) -> dict[str, Any]:
        return self._get(f"/policies/{policy_id}")

    def list_policies(self) -> list[dict[str, Any]]:
        """Every registered policy, newest first."""
        return list(self._pages("/policies", {}))

    def resolve_policy(self, ref: str | int) -> dict[str, Any]:
        """The policy that ``ref`` names: an id, a ``name`` (with one version) or ``name:version``."""
        text = str(ref).strip()
        if text.isdigit():
            return self.get_policy(int(text))
        policies = self.list_policies()
        matches = [p for p in policies if p["name"] == text]
        if not matches and ":" in text:
            name, _, version = text.rpartition(":")
            matches = [p for p in policies if p["name"] == name and p["version"] == version]
        if len(matches) == 1:
            return matches[0]
        if matches:
            versions = ", ".join(f"{p['name']}:{p['version']} (id {p['id']})" for p in matches)
            raise ApiError(None, "ambiguous_policy", f"policy {text!r} has {len(matches)} versions: {versions}; "
                           "name one as NAME:VERSION or by id")
        known = ", ".join(sorted({f"{p['name']}:{p['version']}" for p in policies})[:10]) or "none yet"
        raise ApiError(None, "unknown_policy", f"no policy named {text!r} is registered at {self.api_url} "
                       f"(registered: {known}); register it with `evalforge policy register --name NAME "
                       "--endpoint ws://HOST:PORT/ws`, or pass an id from `evalforge policy list`")

    # ------------------------------------------------------------------ evaluations

    def submit_evaluation(self, policy_id: int, suite: str, episodes_per_task: int, *, seed: int = 0,
                          tasks: list[str] | None = None, max_steps: int | None = None,
                          tags: list[str] | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Start an evaluation; returns its detail (status ``pending``).

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
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        return self._request("POST", "/evaluations", json=body, headers=headers).json()

    def get_evaluation(self, evaluation_id: int) -> dict[str, Any]:
        """Status, episode counts by status, per-task and overall results."""
        return self._get(f"/evaluations/{evaluation_id}")

    def list_evaluations(self, *, limit: int | None = 50, **filters: Any) -> list[dict[str, Any]]:
        """Evaluations, newest first; ``filters``: ``policy_id``, ``suite``, ``status``, ``tag``.
        ``limit=None`` returns all of them."""
        unknown = sorted(set(filters) - _EVALUATION_FILTERS)
        if unknown:
            raise TypeError(f"list_evaluations() got unknown filters {unknown}; "
                            f"use {sorted(_EVALUATION_FILTERS)}")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1 (or None for all), got {limit}")
        params = {k: v for k, v in filters.items() if v is not None}
        return list(self._pages("/evaluations", params, limit))

    def episodes(self, evaluation_id: int) -> list[dict[str, Any]]:
        """Every episode of an evaluation, in index order."""
        return list(self._pages(f"/evaluations/{evaluation_id}/episodes", {}))

    def cancel_evaluation(self, evaluation_id: int) -> dict[str, Any]:
        """Cancel: pending episodes are dropped, running ones finish. A finished evaluation is a 409."""
        return self._request("POST", f"/evaluations/{evaluation_id}/cancel").json()

    def watch_evaluation(self, evaluation_id: int, *, console: Console | None = None, poll_s: float = 1.0,
                         timeout_s: float | None = None) -> dict[str, Any]:
        """Poll until the evaluation is finished, cancelled or failed; return its final detail.

        On a terminal ``console`` (default: stderr) this is a progress bar of episodes
        done, with the success rate so far and the episodes per status; elsewhere (a
        log, a pipe) one line each time the progress changes. ``WatchTimeout`` after
        ``timeout_s`` (default: wait as long as it takes).
        """
        console = console or Console(stderr=True)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        detail = self.get_evaluation(evaluation_id)
        if console.is_terminal:
            columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
            with Progress(*columns, console=console) as progress:
                bar = progress.add_task(f"evaluation {evaluation_id}", total=detail["episodes_total"], stats="")

                def show(d: dict[str, Any]) -> None:
                    progress.update(bar, completed=episodes_done(d), total=d["episodes_total"],
                                    stats=progress_stats(d))

                return self._poll_until_done(detail, show, poll_s, deadline, timeout_s)
        shown: list[str] = []

        def show_line(d: dict[str, Any]) -> None:
            line = f"evaluation {d['id']}: {episodes_done(d)}/{d['episodes_total']} episodes done · {progress_stats(d)}"
            if not shown or shown[-1] != line:
                console.print(line, highlight=False, soft_wrap=True)
                shown.append(line)

        return self._poll_until_done(detail, show_line, poll_s, deadline, timeout_s)

    def _poll_until_done(self, detail: dict[str, Any], show: Callable[[dict[str, Any]], None], poll_s: float,
                         deadline: float | None, timeout_s: float | None) -> dict[str, Any]:
        while True:
            show(detail)
            if detail["status"] in DONE_STATUSES:
                return detail
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WatchTimeout(detail, timeout_s or 0.0)
                time.sleep(min(poll_s, left))
            else:
                time.sleep(poll_s)
            detail = self.get_evaluation(detail["id"])

    # ------------------------------------------------------------------ leaderboard, catalogue, health

    def leaderboard(self, suite: str, *, include_nonstandard: bool = False, limit: int | None = None
                    ) -> dict[str, Any]:
        """Each policy's best finished evaluation on ``suite``, ranked."""
        return self._get("/leaderboard", suite=suite, include_nonstandard=str(include_nonstandard).lower(),
                         limit=limit)

    def suites(self) -> list[dict[str, Any]]:
        """The benchmark suites an evaluation can run (tasks, dimensions, step limits)."""
        return self._get("/suites")

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


# ---------------------------------------------------------------------------- rendering


def episodes_done(detail: dict[str, Any]) -> int:
    """Episodes of an evaluation detail that reached a terminal status."""
    counts = detail.get("counts", {})
    return sum(counts.get(status, 0) for status in TERMINAL_EPISODE_STATUSES)


def progress_stats(detail: dict[str, Any]) -> str:
    """``succeeded 3/4 (75.0%) · pending 2 · running 1 · …``: success so far and episodes per status."""
    overall = detail.get("overall") or {}
    counts = detail.get("counts", {})
    parts = [detail["status"]]
    if overall.get("scored"):
        parts.append(f"success {overall['succeeded']}/{overall['scored']} ({percent(overall['success_rate'])})")
    parts += [f"{status} {counts[status]}" for status in EPISODE_STATUSES if counts.get(status)]
    return " · ".join(parts)


def percent(rate: float | None) -> str:
    return "–" if rate is None else f"{100 * rate:.1f}%"


def interval(ci: dict[str, float] | None) -> str:
    """A Wilson interval as ``[low, high]`` in percent (it is not symmetric, so no ±)."""
    return "–" if not ci else f"[{100 * ci['low']:.1f}, {100 * ci['high']:.1f}]"


def _number(value: float | None, unit: str = "") -> str:
    return "–" if value is None else f"{value:,.1f}{unit}"


def _failures(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in reasons.items() if count) or ""


def _when(value: str | None) -> str:
    if not value:
        return "–"
    try:
        return datetime.fromisoformat(value).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return value


def policy_label(policy: dict[str, Any]) -> str:
    return f"{policy['name']}:{policy['version']}"


def print_results(detail: dict[str, Any], console: Console) -> None:
    """Per-task results of an evaluation: episodes, success rate with its 95% interval, mean steps,
    median policy latency and failure reasons, then the overall row."""
    title = (f"evaluation {detail['id']} · {policy_label(detail['policy'])} · {detail['suite']} · "
             f"{detail['status']}")
    table = Table(title=title, title_justify="left")
    table.add_column("task")
    for column in ("episodes", "success", "95% CI", "mean steps", "latency p50"):
        table.add_column(column, justify="right")
    table.add_column("failures")

    def row(name: str, results: dict[str, Any], style: str | None = None) -> None:
        latency = (results.get("latency_ms") or {}).get("p50")
        success = percent(results["success_rate"])
        if results["scored"]:
            success += f" ({results['succeeded']}/{results['scored']})"
        table.add_row(name, str(results["episodes"]), success, interval(results["ci95"]),
                      _number(results["mean_steps"]), _number(latency, " ms"),
                      _failures(results["failure_reasons"]), style=style)

    for task in detail["per_task"]:
        row(task["task"], task)
    table.add_section()
    row("overall", detail["overall"], style="bold")
    console.print(table)


def print_leaderboard(board: dict[str, Any], console: Console) -> None:
    """A suite's leaderboard: rank, policy, success rate with its 95% interval, episodes, date."""
    scope = " (all evaluations, incl. task subsets)" if board.get("include_nonstandard") else ""
    if not board["entries"]:
        console.print(f"no finished evaluations of every task on {board['suite']} yet{scope}; submit one with "
                      f"`evalforge eval submit --suite {board['suite']} …`", highlight=False)
        return
    table = Table(title=f"leaderboard · {board['suite']}{scope}", title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("policy")
    table.add_column("version")
    for column in ("success", "95% CI", "episodes", "evaluation"):
        table.add_column(column, justify="right")
    table.add_column("finished (UTC)")
    for entry in board["entries"]:
        table.add_row(str(entry["rank"]), entry["policy"]["name"], entry["policy"]["version"],
                      percent(entry["success_rate"]), interval(entry["ci95"]), str(entry["episodes"]),
                      str(entry["evaluation_id"]), _when(entry["finished_at"]))
    console.print(table)
