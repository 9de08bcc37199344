"""Benchmark of the HTML pages with 1,000 policies on the leaderboard, on PostgreSQL; prints a table.

    .venv/bin/python bench/page_load.py [--policies 1000] [--requests 50] [--loads 15]

What it does:

1. creates a scratch database ``evalforge_bench_<random>`` beside ``BENCH_DATABASE_URL``
   (default: the local ``postgres`` database) and migrates it (``bench/eval_api.py``'s helpers);
2. fills it: ``--policies`` policies, each with one finished standard MetaWorld MT10
   evaluation of 10 tasks × 10 episodes (so the MT10 leaderboard ranks them all); policy 1
   also has ``HISTORY`` finished evaluations of 1,000 episodes spread over weeks (its page
   plots them) and one running evaluation of 1,000 episodes, half done (its page computes
   live aggregates). Outcomes and latencies are seeded random draws; everything but the
   running evaluation is finalised by the store's own ``finalize_evaluation_if_done``;
3. serves the API (``evalforge api``, one uvicorn process) against it;
4. times each page from one keep-alive HTTP client (``--requests`` sequential GETs: the
   server's time plus one local round trip), then loads it ``--loads`` times in headless
   Chromium (``/usr/bin/chromium`` via Playwright) and reads the browser's navigation
   timing: time to the first byte, DOMContentLoaded and the load event, from the start of
   navigation (``/`` includes its 307 to ``/ui/``), and on the leaderboard the time to
   "Show all" (reveal the rows past the first 100 and lay the whole table out);
5. drops the scratch database.

Target: each page loads in under 300 ms with 1,000 policies on the leaderboard.
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
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_api import MT10, create_database, drop_database, percentile, serve  # noqa: E402
from services.store import migrate  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.queries import finalize_evaluation_if_done  # noqa: E402

CHROMIUM = os.environ.get("BENCH_CHROMIUM", "/usr/bin/chromium")
HISTORY = 20  # policy 1's finished 1,000-episode evaluations
TARGET_MS = 300


def fill(database_url: str, policies: int) -> dict[str, int]:
    """The rows described above; returns the ids the pages are timed on."""
    engine = create_db_engine(url=database_url)
    tasks_json = "[" + ", ".join(f'"{t}"' for t in MT10) + "]"
    tasks_array = "ARRAY[" + ", ".join(f"'{t}'" for t in MT10) + "]"
    small, big = 10, 100  # episodes per task
    with engine.begin() as connection:
        connection.execute(text("SELECT setseed(0.17)"))
        connection.execute(text(f"""
            INSERT INTO policies (name, version, endpoint, checkpoint_sha256, state_dim, action_dim, chunk_size,
                                  tasks, created_at)
            SELECT 'policy-' || p, 'v1', 'ws://gpu-' || p || '\\:8000/ws', md5(p::text) || md5((p + 1)::text),
                   39, 4, 4, '{tasks_json}'::jsonb, now() - interval '60 days'
            FROM generate_series(1, {policies}) AS p"""))
        # One small evaluation per policy (ids 1..policies), then policy 1's history and its running one.
        connection.execute(text(f"""
            INSERT INTO evaluations (policy_id, suite, tasks, episodes_per_task, seed, standard, status,
                                     episodes_total, created_at, started_at)
            SELECT p, 'metaworld-mt10', '{tasks_json}'::jsonb, {small}, p, true, 'running', {small * len(MT10)},
                   now() - interval '50 days' + p * interval '1 minute', now() - interval '50 days'
            FROM generate_series(1, {policies}) AS p"""))
        connection.execute(text(f"""
            INSERT INTO evaluations (policy_id, suite, tasks, episodes_per_task, seed, standard, status,
                                     episodes_total, created_at, started_at)
            SELECT 1, 'metaworld-mt10', '{tasks_json}'::jsonb, {big}, 100000 + h, true, 'running',
                   {big * len(MT10)}, now() - interval '40 days' + h * interval '2 days',
                   now() - interval '40 days' + h * interval '2 days'
            FROM generate_series(1, {HISTORY + 1}) AS h"""))
        # Success probability rises over policy 1's history (its page draws a line going up).
        connection.execute(text(f"""
            WITH ev AS (SELECT id, episodes_per_task AS per_task, episodes_total AS total,
                               CASE WHEN id <= {policies} THEN 0.1 + 0.85 * random()
                                    ELSE 0.3 + 0.5 * (id - {policies}) / {HISTORY + 1}.0 END AS p
                        FROM evaluations),
                 draws AS (SELECT ev.id, ev.per_task, i, random() AS r, random() AS r2, ev.p
                           FROM ev CROSS JOIN LATERAL generate_series(0, ev.total - 1) AS i)
            INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, success,
                                  total_return, steps, duration_s, latency_mean_ms, latency_p95_ms,
                                  failure_reason, attempts, worker_id, created_at, started_at, finished_at)
            SELECT id, i, ({tasks_array})[i / per_task + 1], 1000000 + i % per_task, 500,
                   CASE WHEN r < p THEN 'succeeded' ELSE 'failed' END, r < p,
                   CASE WHEN r < p THEN 10 * r2 ELSE r2 END,
                   CASE WHEN r < p THEN 40 + (r2 * 400)::int ELSE 500 END,
                   1 + 20 * r2, 8 + 6 * r2 + 6 * r2 * r2 * r2, 15 + 30 * r2,
                   CASE WHEN r >= p AND r2 < 0.01 THEN 'policy_timeout' END,
                   1, 'worker-' || (i % 32), now() - interval '50 days', now() - interval '50 days',
                   now() - interval '50 days'
            FROM draws"""))
        running = policies + HISTORY + 1
        connection.execute(text(f"""
            UPDATE episodes SET status = CASE WHEN episode_index % 3 = 0 THEN 'pending' ELSE 'running' END,
                   success = NULL, steps = NULL, total_return = NULL, failure_reason = NULL, finished_at = NULL,
                   latency_mean_ms = NULL, latency_p95_ms = NULL,
                   lease_expires_at = CASE WHEN episode_index % 3 = 0 THEN NULL ELSE now() + interval '1 hour' END
            WHERE evaluation_id = {running} AND episode_index >= {big * len(MT10) // 2}"""))
    with make_session_factory(engine)() as session:
        for evaluation_id in range(1, running):
            assert finalize_evaluation_if_done(session, evaluation_id)
    with engine.begin() as connection:
        connection.execute(text("UPDATE evaluations SET finished_at = created_at + interval '3 hours' "
                                f"WHERE id < {running}"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return {"finished": policies + HISTORY, "running": running, "policy": 1}


def server_times(client: httpx.Client, path: str, n: int) -> tuple[list[float], int]:
    times, size = [], 0
    for _ in range(n):
        start = time.perf_counter()
        response = client.get(path, follow_redirects=True)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
        size = len(response.content)
    return times, size


def browser_times(base: str, path: str, n: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    timings: dict[str, list[float]] = {"ttfb": [], "body": [], "dcl": [], "load": []}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(base + path)  # warm the browser process
        for _ in range(n):
            page.goto("about:blank")
            page.goto(base + path, wait_until="load")
            entry = page.evaluate("() => performance.getEntriesByType('navigation')[0].toJSON()")
            timings["ttfb"].append(entry["responseStart"] - entry["startTime"])
            timings["body"].append(entry["responseEnd"] - entry["startTime"])
            timings["dcl"].append(entry["domContentLoadedEventEnd"] - entry["startTime"])
            timings["load"].append(entry["loadEventEnd"] - entry["startTime"])
            if page.locator("#show-all").count():  # the leaderboard's hidden rows: reveal and lay them out
                timings.setdefault("show_all", []).append(page.evaluate(
                    "() => { const t = performance.now(); document.getElementById('show-all').click();"
                    " document.body.getBoundingClientRect(); return performance.now() - t; }"))
        browser.close()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=50, help="timed HTTP requests per page")
    parser.add_argument("--loads", type=int, default=15, help="timed browser loads per page")
    args = parser.parse_args()
    if not os.access(CHROMIUM, os.X_OK):
        sys.exit(f"{CHROMIUM} is missing: run `make setup` (installs Debian's chromium) or set BENCH_CHROMIUM")

    database_url = create_database()
    proc = None
    try:
        migrate.upgrade(database_url)
        start = time.perf_counter()
        ids = fill(database_url, args.policies)
        fill_s = time.perf_counter() - start
        engine = create_db_engine(url=database_url)
        with engine.connect() as connection:
            episodes = connection.execute(text("SELECT count(*) FROM episodes")).scalar_one()
        engine.dispose()
        proc, base = serve(database_url, f"episodes-bench-{secrets.token_hex(4)}")
        pages = [(f"/ (307 → leaderboard, MT10: {args.policies:,} rows)", "/"),
                 ("/ui/evaluations/{id} (finalised, 1,000 episodes)", f"/ui/evaluations/{ids['finished']}"),
                 ("/ui/evaluations/{id} (running, 1,000 episodes, live)", f"/ui/evaluations/{ids['running']}"),
                 (f"/ui/policies/{{id}} ({HISTORY + 2} evaluations)", f"/ui/policies/{ids['policy']}")]
        rows = []
        load_before = os.getloadavg()[0]
        with httpx.Client(base_url=base, timeout=30) as client:
            for _, path in pages:
                server_times(client, path, 5)  # warm
            for name, path in pages:
                times, size = server_times(client, path, args.requests)
                rows.append((name, path, times, size))
        loads = {path: browser_times(base, path, args.loads) for _, path in pages}

        print(f"\nEvalForge pages benchmark — PostgreSQL, {args.policies:,} policies ranked on metaworld-mt10, "
              f"{episodes:,} episode rows (filled in {fill_s:.0f} s)")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
              "server: one uvicorn process (`evalforge api`); HTTP client: one keep-alive connection, "
              f"{args.requests} sequential GETs per page; browser: headless Chromium, {args.loads} loads per page\n")
        print(f"load average (1 min) before the timings: {load_before:.1f}, after: {os.getloadavg()[0]:.1f} — "
              f"on a shared machine, p50/p95 include waiting for a core; min is the page's own cost\n")
        print("| page | HTML KiB | server p50 ms | server p95 ms | browser first byte p50 ms | last byte p50 ms | "
              "DOMContentLoaded p50 ms | load p50 ms | load p95 ms | load min ms | p50 < 300 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|")
        for name, path, times, size in rows:
            load = loads[path]
            met = "yes" if max(statistics.median(times), statistics.median(load["load"])) < TARGET_MS else "NO"
            print(f"| {name} | {size / 1024:.0f} | {statistics.median(times):.1f} | {percentile(times, 95):.1f} | "
                  f"{statistics.median(load['ttfb']):.1f} | {statistics.median(load['body']):.1f} | "
                  f"{statistics.median(load['dcl']):.1f} | {statistics.median(load['load']):.1f} | "
                  f"{percentile(load['load'], 95):.1f} | {min(load['load']):.1f} | {met} |")
        for _, path, _, _ in rows:
            if "show_all" in loads[path]:
                reveal = loads[path]["show_all"]
                print(f"\n{path}: “Show all” (un-hide the other rows, style and lay out the whole table): "
                      f"p50 {statistics.median(reveal):.1f} ms, min {min(reveal):.1f} ms")
    finally:
        if proc is not None:
            proc.stop()
        drop_database(database_url)


if __name__ == "__main__":
    main()
