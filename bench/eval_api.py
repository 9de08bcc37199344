"""Benchmark of the evaluation API on PostgreSQL with 1 M episode rows; prints a table.

    .venv/bin/python bench/eval_api.py [--evaluations 1000] [--episodes-per-task 100] [--requests 300]

What it does:

1. creates a scratch database ``evalforge_bench_<random>`` beside ``BENCH_DATABASE_URL``
   (default: the local ``postgres`` database) and migrates it;
2. fills it: 100 policies, ``--evaluations`` MetaWorld MT10 evaluations of 10 tasks ×
   ``--episodes-per-task`` episodes (default 1,000 × 1,000 = 1 M rows), the episodes
   written in one ``INSERT … SELECT … generate_series`` with seeded random outcomes;
   every evaluation but the last 10 is finalised through the store's own
   ``finalize_evaluation_if_done``, the last 10 stay running (their detail is computed live);
3. serves the API (``evalforge api``, one uvicorn process) against it, with Redis as the
   broker on a scratch queue name;
4. times, from one keep-alive HTTP client: ``GET /leaderboard?suite=metaworld-mt10``,
   ``GET /evaluations/{id}`` (finalised and running), and ``POST /evaluations`` of
   1,000 episodes (time to the 202; and, separately, until all 1,000 messages are on the
   Redis queue — publishing runs after the response);
5. drops the scratch database and the queue.

Targets: leaderboard p95 ≤ 50 ms; evaluation detail p95 ≤ 50 ms; 1,000-episode submit ≤ 300 ms.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path

import httpx
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.store import migrate  # noqa: E402
from services.store.api_keys import create_api_key  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.queries import finalize_evaluation_if_done  # noqa: E402
from services.supervisor import ChildProcess, free_port  # noqa: E402

BASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
MT10 = ["reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
        "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3"]
POLICIES = 100
RUNNING = 10


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def create_database() -> str:
    url = make_url(BASE_URL)
    name = f"evalforge_bench_{secrets.token_hex(4)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return url.set(database=name).render_as_string(hide_password=False)


def drop_database(database_url: str) -> None:
    admin = create_engine(make_url(BASE_URL), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{make_url(database_url).database}" WITH (FORCE)')
    admin.dispose()


def fill(database_url: str, evaluations: int, per_task: int) -> dict[str, float]:
    """Policies, evaluations and their episodes; returns seconds per phase."""
    timings = {}
    engine = create_db_engine(url=database_url)
    tasks_json = "[" + ", ".join(f'"{t}"' for t in MT10) + "]"
    tasks_array = "ARRAY[" + ", ".join(f"'{t}'" for t in MT10) + "]"
    per_evaluation = per_task * len(MT10)
    start = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(text("SELECT setseed(0.42)"))
        connection.execute(text(f"""
            INSERT INTO policies (name, version, endpoint, checkpoint_sha256, state_dim, action_dim, chunk_size,
                                  tasks, created_at)
            SELECT 'policy-' || p, 'v1', 'ws://gpu-' || p || '\\:8000/ws', md5(p::text) || md5((p + 1)::text),
                   39, 4, 4, '{tasks_json}'::jsonb, now() - interval '30 days'
            FROM generate_series(1, {POLICIES}) AS p"""))
        connection.execute(text(f"""
            INSERT INTO evaluations (policy_id, suite, tasks, episodes_per_task, seed, standard, status,
                                     episodes_total, created_at, started_at)
            SELECT 1 + (e % {POLICIES}), 'metaworld-mt10', '{tasks_json}'::jsonb, {per_task}, e * {per_task},
                   true, 'running', {per_evaluation}, now() - interval '20 days' + e * interval '1 minute',
                   now() - interval '20 days' + e * interval '1 minute'
            FROM generate_series(1, {evaluations}) AS e"""))
        # Each evaluation gets its own success probability; episodes draw against it.
        connection.execute(text(f"""
            WITH ev AS (SELECT id, 0.2 + 0.7 * random() AS p FROM evaluations),
                 draws AS (SELECT ev.id, i, random() AS r, random() AS r2, ev.p
                           FROM ev CROSS JOIN generate_series(0, {per_evaluation - 1}) AS i)
            INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, success,
                                  total_return, steps, duration_s, latency_mean_ms, latency_p95_ms,
                                  failure_reason, attempts, worker_id, created_at, started_at, finished_at)
            SELECT id, i, ({tasks_array})[i / {per_task} + 1], 1000000 + id * {per_task} + i % {per_task}, 500,
                   CASE WHEN r < p THEN 'succeeded' ELSE 'failed' END,
                   r < p,
                   CASE WHEN r < p THEN 10 * r2 ELSE r2 END,
                   CASE WHEN r < p THEN 40 + (r2 * 400)::int ELSE 500 END,
                   1 + 20 * r2,
                   8 + 10 * r2, 15 + 30 * r2,
                   CASE WHEN r >= p AND r2 < 0.01 THEN 'policy_timeout'
                        WHEN r >= p AND r2 < 0.015 THEN 'env_error' END,
                   1, 'worker-' || (i % 32), now() - interval '20 days', now() - interval '20 days',
                   now() - interval '19 days'
            FROM draws"""))
    timings[f"insert {evaluations * per_evaluation:,} episodes (INSERT … SELECT generate_series)"] = \
        time.perf_counter() - start

    start = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(text(f"""
            UPDATE episodes SET status = CASE WHEN episode_index % 3 = 0 THEN 'pending' ELSE 'running' END,
                   success = NULL, steps = NULL, total_return = NULL, failure_reason = NULL, finished_at = NULL,
                   lease_expires_at = CASE WHEN episode_index % 3 = 0 THEN NULL ELSE now() + interval '1 hour' END
            WHERE evaluation_id > {evaluations - RUNNING} AND episode_index >= {per_evaluation // 2}"""))
    sessions = make_session_factory(engine)
    with sessions() as session:
        for evaluation_id in range(1, evaluations - RUNNING + 1):
            assert finalize_evaluation_if_done(session, evaluation_id)
    timings[f"finalise {evaluations - RUNNING} evaluations (store query, one by one)"] = time.perf_counter() - start
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return timings


def serve(database_url: str, queue: str, log_dir: Path | None = None) -> tuple[ChildProcess, str]:
    """``evalforge api`` on a free port against ``database_url``, once ``/readyz`` answers; (process, base URL)."""
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "EVALFORGE_EPISODE_QUEUE": queue,
           "EVALFORGE_MAX_EPISODES_PER_EVALUATION": "10000"}
    base = f"http://127.0.0.1:{port}"
    log_path = (log_dir or REPO / "runs" / "bench") / f"api-{port}.log"
    api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--log-level", "warning"],
                       log_path, health=f"{base}/readyz", env=env, cwd=REPO, startup_timeout_s=60)
    return api.start().wait_healthy(), base


def timed(client: httpx.Client, requests: list[tuple[str, str, dict]], expect: int) -> list[float]:
    times = []
    for method, path, kwargs in requests:
        start = time.perf_counter()
        response = client.request(method, path, **kwargs)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == expect, (path, response.status_code, response.text[:300])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluations", type=int, default=1000)
    parser.add_argument("--episodes-per-task", type=int, default=100)
    parser.add_argument("--requests", type=int, default=300, help="timed requests per GET row")
    parser.add_argument("--submits", type=int, default=30, help="timed 1,000-episode submissions")
    args = parser.parse_args()

    database_url = create_database()
    queue = f"episodes-bench-{secrets.token_hex(4)}"
    broker = redis.Redis.from_url(REDIS_URL)
    proc = None
    try:
        migrate.upgrade(database_url)
        setup = fill(database_url, args.evaluations, args.episodes_per_task)
        engine = create_db_engine(url=database_url)
        with make_session_factory(engine)() as session:
            _, key = create_api_key(session, "bench")
            rows = session.execute(text("SELECT count(*) FROM episodes")).scalar_one()
        engine.dispose()
        proc, base = serve(database_url, queue)
        results = []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            finished_ids = [1 + (i * 7919) % (args.evaluations - RUNNING) for i in range(args.requests)]
            running_ids = [args.evaluations - RUNNING + 1 + i % RUNNING for i in range(args.requests)]
            board = [("GET", "/leaderboard", {"params": {"suite": "metaworld-mt10"}})] * args.requests
            warm = board[:20] + [("GET", f"/evaluations/{i}", {}) for i in finished_ids[:20] + running_ids[:20]]
            timed(client, warm, 200)
            results.append(("GET /leaderboard?suite=metaworld-mt10", timed(client, board, 200), 50))
            size = f"{args.episodes_per_task * len(MT10):,} episodes"
            results.append((f"GET /evaluations/{{id}} (finalised, {size})",
                            timed(client, [("GET", f"/evaluations/{i}", {}) for i in finished_ids], 200), 50))
            results.append((f"GET /evaluations/{{id}} (running, {size}, live aggregates)",
                            timed(client, [("GET", f"/evaluations/{i}", {}) for i in running_ids], 200), 50))
            submit_times, enqueue_times = [], []
            body = {"policy_id": 1, "suite": "metaworld-mt10", "episodes_per_task": 100, "seed": 0}
            for i in range(args.submits + 3):
                before = broker.llen(queue)
                start = time.perf_counter()
                response = client.post("/evaluations", json={**body, "seed": 1000 + i})
                submitted = time.perf_counter()
                assert response.status_code == 202, response.text[:300]
                assert response.json()["episodes_total"] == 1000
                while broker.llen(queue) < before + 1000:
                    time.sleep(0.002)
                    assert time.perf_counter() - start < 30, "episodes never reached the queue"
                if i >= 3:  # the first few warm the insert path
                    submit_times.append((submitted - start) * 1000)
                    enqueue_times.append((time.perf_counter() - start) * 1000)
            results.append(("POST /evaluations, 1,000 episodes (until the 202)", submit_times, 300))
            results.append(("… until all 1,000 tasks are on the Redis queue", enqueue_times, None))

        print(f"\nEvalForge API benchmark — PostgreSQL, {rows:,} episode rows in {args.evaluations:,} evaluations "
              f"of {args.episodes_per_task * len(MT10):,} episodes, {POLICIES} policies")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
              "server: one uvicorn process; client: one keep-alive connection, sequential requests\n")
        for phase, seconds in setup.items():
            print(f"setup: {phase}: {seconds:.1f} s")
        print()
        print("| request | n | p50 ms | p95 ms | max ms | target p95 | met |")
        print("|---|---:|---:|---:|---:|---:|:-:|")
        for name, times, target in results:
            p95 = percentile(times, 95)
            met = "—" if target is None else ("yes" if p95 <= target else "NO")
            print(f"| {name} | {len(times)} | {statistics.median(times):.1f} | {p95:.1f} | {max(times):.1f} | "
                  f"{'—' if target is None else f'≤ {target} ms'} | {met} |")
    finally:
        if proc is not None:
            proc.stop()
        broker.delete(*(broker.keys(f"*{queue}*") or [queue]))
        drop_database(database_url)


if __name__ == "__main__":
    main()
