"""Load test of the evaluation API on PostgreSQL: many clients submitting and polling at once; prints a table.

    .venv/bin/python bench/api_load.py [--clients 50] [--duration 60] [--polls 3]

What it does:

1. creates a scratch database ``evalforge_bench_<random>`` beside ``BENCH_DATABASE_URL``
   (default: the local ``postgres`` database), migrates it, and stores one policy and one
   API key in it (no policy server is needed: submissions do not contact it);
2. serves the API (``evalforge api``: one real uvicorn process) against it, with Redis as the
   broker on a scratch queue name; no workers run, so every episode stays queued;
3. runs ``--clients`` concurrent clients for ``--duration`` seconds, each in a loop: submit an
   evaluation of MetaWorld MT10 with one episode per task (``POST /evaluations``, 10 episodes,
   with an ``Idempotency-Key``), then poll it ``--polls`` times (``GET /evaluations/{id}``) and
   read one page of its episodes (``GET /evaluations/{id}/episodes``);
4. checks that no response was a 5xx and that no submission was lost: every 202 names an
   evaluation that is in the database with all its episode rows, and every episode id reached
   the Redis queue;
5. prints p50/p95/p99 latency per request kind, throughput and status counts; drops the scratch
   database and the queue.

``run_load`` (the clients) and ``lost_submissions`` (the check) are what
``tests/eval_api/test_api_load.py`` runs for a few seconds with 10 clients, with no timing
assertions. Latency here is measured at the client: on a shared 2-core machine the load
generator, the API and PostgreSQL compete for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.supervisor import ChildProcess, free_port  # noqa: E402

BASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
SUITE, TASKS = "metaworld-mt10", 10
EPISODES_PER_TASK = 1
POOL_SIZE = 10  # the API's database connections


@dataclass
class LoadReport:
    """What the clients saw: latencies (ms) and status codes per request kind, and every accepted submission."""

    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    accepted: dict[int, int] = field(default_factory=dict)  # evaluation id → episodes its 202 promised
    errors: list[str] = field(default_factory=list)  # 5xx bodies and transport failures (first ones)
    duration_s: float = 0.0

    def record(self, kind: str, status: int | str, ms: float) -> None:
        self.latencies_ms[kind].append(ms)
        self.statuses[kind][status] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for counts in self.statuses.values() for status, n in counts.items()
                   if not isinstance(status, int) or status >= 500)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def _client(base_url: str, headers: dict[str, str], policy_id: int, until: float, polls: int,
                  report: LoadReport, index: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:

        async def call(kind: str, method: str, path: str, **kwargs) -> httpx.Response | None:
            start = time.perf_counter()
            try:
                response = await client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:  # a dropped connection or a timeout counts as a server error
                report.record(kind, type(exc).__name__, (time.perf_counter() - start) * 1000)
                if len(report.errors) < 20:
                    report.errors.append(f"{method} {path}: {type(exc).__name__}: {exc}")
                return None
            report.record(kind, response.status_code, (time.perf_counter() - start) * 1000)
            if response.status_code >= 500 and len(report.errors) < 20:
                report.errors.append(f"{method} {path}: {response.status_code} {response.text[:300]}")
            return response

        submission = 0
        while time.monotonic() < until:
            submission += 1
            body = {"policy_id": policy_id, "suite": SUITE, "episodes_per_task": EPISODES_PER_TASK,
                    "seed": index * 1_000_000 + submission, "tags": ["load"]}
            response = await call("POST /evaluations", "POST", "/evaluations", json=body,
                                  headers={"Idempotency-Key": f"load-{index}-{submission}-{secrets.token_hex(4)}"})
            if response is None or response.status_code != 202:
                await asyncio.sleep(0.1)
                continue
            created = response.json()
            report.accepted[created["id"]] = TASKS * EPISODES_PER_TASK
            for _ in range(polls):
                if time.monotonic() >= until:
                    break
                await call("GET /evaluations/{id}", "GET", f"/evaluations/{created['id']}")
            if time.monotonic() < until:
                await call("GET /evaluations/{id}/episodes", "GET", f"/evaluations/{created['id']}/episodes",
                           params={"limit": 20})


async def _run(base_url: str, headers: dict[str, str], policy_id: int, clients: int, duration_s: float,
               polls: int) -> LoadReport:
    report = LoadReport()
    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(*(_client(base_url, headers, policy_id, until, polls, report, i) for i in range(clients)))
    report.duration_s = time.monotonic() - started
    return report


def run_load(base_url: str, api_key: str, policy_id: int, *, clients: int = 50, duration_s: float = 60.0,
             polls: int = 3) -> LoadReport:
    """``clients`` concurrent clients submitting and polling against the API at ``base_url`` for ``duration_s``."""
    return asyncio.run(_run(base_url, {"Authorization": f"Bearer {api_key}"}, policy_id, clients, duration_s, polls))


def lost_submissions(database_url: str, report: LoadReport, *, redis_url: str | None = None,
                     queue: str | None = None, wait_s: float = 30.0) -> list[str]:
    """What was lost: each accepted evaluation missing from the store or short of its episode rows, and
    (with ``redis_url`` and ``queue``) episode ids that never reached the broker. Empty: nothing lost."""
    from sqlalchemy import func, select

    from services.store.db import create_db_engine, make_session_factory
    from services.store.models import Episode

    engine = create_db_engine(url=database_url)
    problems = []
    try:
        with make_session_factory(engine)() as session:
            counts = dict(session.execute(
                select(Episode.evaluation_id, func.count()).where(Episode.evaluation_id.in_(list(report.accepted)))
                .group_by(Episode.evaluation_id)).all()) if report.accepted else {}
            episode_ids = set(session.scalars(select(Episode.id).where(
                Episode.evaluation_id.in_(list(report.accepted))))) if report.accepted else set()
    finally:
        engine.dispose()
    for evaluation_id, expected in sorted(report.accepted.items()):
        if counts.get(evaluation_id, 0) != expected:
            problems.append(f"evaluation {evaluation_id}: its 202 promised {expected} episodes, the store has "
                            f"{counts.get(evaluation_id, 0)}")
    if redis_url and queue:
        queued = _queued_episode_ids(redis_url, queue, len(episode_ids), wait_s)
        missing = episode_ids - queued
        if missing:
            problems.append(f"{len(missing)} of {len(episode_ids)} episodes never reached the queue {queue!r} "
                            f"(e.g. {sorted(missing)[:5]})")
    return problems


def _queued_episode_ids(redis_url: str, queue: str, expected: int, wait_s: float) -> set[int]:
    """The episode ids of the Celery messages on ``queue`` (publishing runs after each 202: wait for it)."""
    import base64
    import json

    import redis

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + wait_s
    while client.llen(queue) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    ids = set()
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        args = body[0] if isinstance(body, list) else body.get("args", [])
        ids.update(int(a) for a in args)
    client.close()
    return ids


# ---------------------------------------------------------------------------- the script


def prepare(database_url: str) -> tuple[str, int]:
    """Migrate the scratch database and store a key and a policy in it; (API key, policy id)."""
    from benchmarks.registry import get_suite
    from services.store import migrate, queries
    from services.store.api_keys import create_api_key
    from services.store.db import create_db_engine, make_session_factory

    migrate.upgrade(database_url)
    engine = create_db_engine(url=database_url)
    try:
        with make_session_factory(engine)() as session:
            _, key = create_api_key(session, "api-load")
            policy = queries.create_policy(
                session, name="load", version="v1", endpoint="ws://policy.bench:8000/ws", checkpoint_sha256="ab" * 32,
                state_dim=39, action_dim=4, chunk_size=4, tasks=[spec.name for spec in get_suite(SUITE).tasks])
            return key, policy.id
    finally:
        engine.dispose()


def serve(database_url: str, queue: str, log_dir: Path) -> tuple[ChildProcess, str]:
    """``evalforge api`` (uvicorn) on a free port against ``database_url``, once ``/readyz`` answers."""
    port = free_port()
    # A bounded pool (the server is shared: max_connections 100 here): requests wait for a connection
    # rather than open more than the server takes ("too many clients already").
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "EVALFORGE_EPISODE_QUEUE": queue,
           "EVALFORGE_MAX_QUEUED_EPISODES": "100000000", "EVALFORGE_DB_POOL_SIZE": str(POOL_SIZE),
           "EVALFORGE_DB_MAX_OVERFLOW": "0"}
    base = f"http://127.0.0.1:{port}"
    api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--log-level", "warning"],
                       log_dir / f"api-load-{port}.log", health=f"{base}/readyz", env=env, cwd=REPO,
                       startup_timeout_s=60)
    return api.start().wait_healthy(), base


def print_table(report: LoadReport, clients: int) -> None:
    print(f"\n{clients} clients for {report.duration_s:.1f} s; {len(report.accepted)} submissions accepted "
          f"({len(report.accepted) / report.duration_s:.1f}/s, {len(report.accepted) * TASKS} episodes)\n")
    print(f"| {'request':<32} | {'count':>6} | {'req/s':>6} | {'p50 ms':>7} | {'p95 ms':>7} | {'p99 ms':>7} | "
          f"statuses")
    print(f"|{'-' * 34}|{'-' * 8}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 10}")
    for kind, values in report.latencies_ms.items():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(report.statuses[kind].items(), key=str))
        print(f"| {kind:<32} | {len(values):>6} | {len(values) / report.duration_s:>6.1f} | "
              f"{percentile(values, 50):>7.1f} | {percentile(values, 95):>7.1f} | {percentile(values, 99):>7.1f} | "
              f"{statuses}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--polls", type=int, default=3, help="GET /evaluations/{id} per submission")
    args = parser.parse_args()
    import redis

    sys.path.insert(0, str(REPO / "bench"))
    # the scratch database, as bench/eval_api.py makes it
    from eval_api import create_database, drop_database

    queue = f"bench_load_{secrets.token_hex(4)}"
    database_url = create_database()
    log_dir = REPO / "runs" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    api = None
    try:
        key, policy_id = prepare(database_url)
        api, base = serve(database_url, queue, log_dir)
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
              f"API: one uvicorn process on PostgreSQL ({POOL_SIZE} pooled connections), Redis broker, no workers")
        report = run_load(base, key, policy_id, clients=args.clients, duration_s=args.duration, polls=args.polls)
        print_table(report, args.clients)
        lost = lost_submissions(database_url, report, redis_url=REDIS_URL, queue=f"{queue}.metaworld")
        print(f"\n5xx or failed requests: {report.server_errors}; lost submissions: {len(lost)}")
        for line in report.errors[:10] + lost[:10]:
            print(f"  {line}")
        return 0 if not report.server_errors and not lost else 1
    finally:
        if api is not None:
            api.stop()
        redis.Redis.from_url(REDIS_URL).delete(f"{queue}.metaworld")
        drop_database(database_url)


if __name__ == "__main__":
    raise SystemExit(main())
