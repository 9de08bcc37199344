"""Benchmark of the leaderboard at 1,000 policies on PostgreSQL: the API, the page, and the pairing's queries.

    .venv/bin/python bench/leaderboard.py [--policies 1000] [--episodes-per-task 10]

What it does:

1. creates a scratch database beside ``BENCH_DATABASE_URL`` (``bench/eval_api.py``'s helpers) and
   migrates it;
2. fills it: ``--policies`` policies, each with one finished standard MetaWorld MT10 evaluation
   of 10 tasks × ``--episodes-per-task`` episodes, every fourth policy with a second one (pooled);
   half the policies run seeds from 0, half from 500, so neighbours on the board compare both
   paired (shared seeds) and unpaired (Newcombe); outcomes drawn with a per-evaluation success
   probability (``INSERT … SELECT generate_series``), finalised through the store's own
   ``finalize_evaluation_if_done``, under the suite's current definition;
3. in-process, ranks the board (``queries.leaderboard``, limit 1,000) with the batched pairing and
   with the one-query-per-entry pairing it replaced (emulated: the same reads, one pool at a time),
   counting statements and timing each;
4. serves the API (``evalforge api``) and times ``GET /leaderboard?limit=1000`` and the leaderboard
   page ``GET /ui/?suite=metaworld-mt10`` (1,000 rows);
5. drops the scratch database.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import event, text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_api import MT10, create_database, drop_database, percentile, serve  # noqa: E402
from benchmarks.registry import get_suite  # noqa: E402
from services.store import migrate, queries  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402

SUITE = "metaworld-mt10"


def fill(database_url: str, policies: int, per_task: int) -> tuple[int, int, float]:
    """(evaluations, episodes, seconds)."""
    engine = create_db_engine(url=database_url)
    definition = get_suite(SUITE).definition_hash()
    tasks_json = "[" + ", ".join(f'"{t}"' for t in MT10) + "]"
    tasks_array = "ARRAY[" + ", ".join(f"'{t}'" for t in MT10) + "]"
    per_evaluation = per_task * len(MT10)
    start = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(text("SELECT setseed(0.17)"))
        connection.execute(text(f"""
            INSERT INTO policies (name, version, endpoint, checkpoint_sha256, state_dim, action_dim, chunk_size,
                                  tasks, created_at)
            SELECT 'policy-' || p, 'v1', 'ws://gpu-' || p || '\\:8000/ws', md5(p::text) || md5((p + 1)::text),
                   39, 4, 4, '{tasks_json}'::jsonb, now() - interval '30 days'
            FROM generate_series(1, {policies}) AS p"""))
        # One evaluation per policy, a second for every fourth; seeds from 0 or 500 by the policy's parity.
        connection.execute(text(f"""
            INSERT INTO evaluations (policy_id, suite, tasks, episodes_per_task, seed, standard, status,
                                     episodes_total, definition_hash, created_at, started_at)
            SELECT p, '{SUITE}', '{tasks_json}'::jsonb, {per_task}, 500 * (p % 2), true, 'running',
                   {per_evaluation}, '{definition}', now() - interval '20 days', now() - interval '20 days'
            FROM generate_series(1, {policies}) AS p, generate_series(1, 2) AS k
            WHERE k = 1 OR p % 4 = 0"""))
        connection.execute(text(f"""
            WITH ev AS (SELECT id, seed, 0.1 + 0.8 * random() AS p FROM evaluations),
                 draws AS (SELECT ev.id, ev.seed, i, random() AS r, ev.p
                           FROM ev CROSS JOIN generate_series(0, {per_evaluation - 1}) AS i)
            INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, success, steps,
                                  attempts, created_at, finished_at)
            SELECT id, i, ({tasks_array})[i / {per_task} + 1], 1000000 + seed + i % {per_task}, 500,
                   CASE WHEN r < p THEN 'succeeded' ELSE 'failed' END, r < p,
                   CASE WHEN r < p THEN 100 ELSE 500 END, 1, now() - interval '20 days', now() - interval '19 days'
            FROM draws"""))
    sessions = make_session_factory(engine)
    with sessions() as session:
        ids = list(session.scalars(text("SELECT id FROM evaluations ORDER BY id")))
        for evaluation_id in ids:
            assert queries.finalize_evaluation_if_done(session, evaluation_id)
        episodes = session.execute(text("SELECT count(*) FROM episodes")).scalar_one()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return len(ids), episodes, time.perf_counter() - start


def per_entry_pairing(session, pool_of):
    """The pairing as it was: one outcomes query per leaderboard entry (the same reads, pool by pool)."""
    batched = ORIGINAL_PAIRING
    pools: dict[int, dict[int, int]] = {}
    for evaluation_id, pool in pool_of.items():
        pools.setdefault(pool, {})[evaluation_id] = pool
    out = {}
    for members in pools.values():
        out.update(batched(session, members))
    return out


ORIGINAL_PAIRING = queries._scored_outcomes_by_pool


def rank(database_url: str, pairing, repeats: int) -> tuple[list[float], int, list]:
    """Milliseconds per ranking of the whole board, statements per ranking, the board's
    (policy id, difference from above, marked) rows."""
    engine = create_db_engine(url=database_url)
    statements = 0

    def counted(*_args):
        nonlocal statements
        statements += 1

    queries._scored_outcomes_by_pool = pairing
    times, board = [], []
    try:
        definition = get_suite(SUITE).definition_hash()
        with make_session_factory(engine)() as session:
            queries.leaderboard(session, SUITE, definition_hash=definition, limit=1000)  # warm
            event.listen(engine, "before_cursor_execute", counted)
            for _ in range(repeats):
                start = time.perf_counter()
                board = queries.leaderboard(session, SUITE, definition_hash=definition, limit=1000)
                times.append((time.perf_counter() - start) * 1000)
                board = [(e.policy.id, e.versus_above, e.not_different_from_above) for e in board]
                session.rollback()
            event.remove(engine, "before_cursor_execute", counted)
    finally:
        queries._scored_outcomes_by_pool = ORIGINAL_PAIRING
        engine.dispose()
    return times, statements // repeats, board


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=1000)
    parser.add_argument("--episodes-per-task", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5, help="rankings timed per variant")
    parser.add_argument("--requests", type=int, default=10, help="timed HTTP requests per row")
    args = parser.parse_args()

    database_url = create_database()
    proc = None
    try:
        migrate.upgrade(database_url)
        evaluations, episodes, setup_s = fill(database_url, args.policies, args.episodes_per_task)
        batched, batched_statements, board = rank(database_url, ORIGINAL_PAIRING, args.repeats)
        per_entry, per_entry_statements, old_board = rank(database_url, per_entry_pairing, args.repeats)
        assert board == old_board, "the batched pairing must give the board the per-entry one gave"
        methods = [versus.method for _, versus, _ in board[1:]]
        marked = sum(mark for _, _, mark in board)

        proc, base = serve(database_url, "episodes-bench-leaderboard")
        http = []
        with httpx.Client(base_url=base, timeout=120) as client:
            for name, path, params in (
                    ("GET /leaderboard?suite=metaworld-mt10&limit=1000", "/leaderboard", {"suite": SUITE,
                                                                                         "limit": 1000}),
                    (f"GET /ui/?suite=metaworld-mt10 (the page, {args.policies:,} rows)", "/ui/", {"suite": SUITE})):
                client.get(path, params=params).raise_for_status()  # warm
                times = []
                for _ in range(args.requests):
                    start = time.perf_counter()
                    response = client.get(path, params=params)
                    times.append((time.perf_counter() - start) * 1000)
                    assert response.status_code == 200, response.text[:300]
                http.append((name, times, len(response.content)))

        print(f"\nEvalForge leaderboard benchmark — PostgreSQL, {args.policies:,} policies, {evaluations:,} finished "
              f"evaluations, {episodes:,} episodes ({args.episodes_per_task} per task × 10 tasks each)")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
              f"setup {setup_s:.0f} s; board: {len(board)} entries, neighbours compared "
              f"{methods.count('paired')} paired / {methods.count('unpaired')} unpaired, {marked} marked "
              "not different from the one above\n")
        print("| ranking the whole board (queries.leaderboard, in-process) | statements | p50 ms | max ms |")
        print("|---|---:|---:|---:|")
        for name, times, statements in (("batched pairing (this change)", batched, batched_statements),
                                        ("one pairing query per entry (before)", per_entry, per_entry_statements)):
            print(f"| {name} | {statements} | {statistics.median(times):.0f} | {max(times):.0f} |")
        print(f"\nper-entry / batched, median: {statistics.median(per_entry) / statistics.median(batched):.2f}×\n")
        print("| request (evalforge api, one uvicorn process) | n | p50 ms | p95 ms | bytes |")
        print("|---|---:|---:|---:|---:|")
        for name, times, size in http:
            print(f"| {name} | {len(times)} | {statistics.median(times):.0f} | {percentile(times, 95):.0f} | "
                  f"{size:,} |")
    finally:
        if proc is not None:
            proc.stop()
        drop_database(database_url)


if __name__ == "__main__":
    main()
