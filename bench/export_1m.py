"""Benchmark of streaming a 1,000,000-episode evaluation's export from the API on PostgreSQL; prints a table.

    .venv/bin/python bench/export_1m.py [--episodes 1000000] [--formats jsonl,csv]

What it does:

1. creates a scratch database beside ``BENCH_DATABASE_URL`` (``bench/eval_api.py``'s helpers),
   migrates it, and bulk-inserts one finished MetaWorld MT10 evaluation of ``--episodes``
   episodes with every column a worker writes (one ``INSERT … SELECT generate_series``, in the
   server: no row crosses the wire);
2. serves the API (``evalforge api``, one uvicorn process) and, for each format, streams
   ``GET /evaluations/{id}/episodes?format=…`` to /dev/null from one client, counting rows and bytes,
   while a thread samples the API process's resident memory (``/proc/<pid>/status`` VmRSS, every
   20 ms; VmHWM after);
3. drops the scratch database.

What it shows: time to first byte, rows/s, and the API's peak RSS above its RSS before the export,
against the size of the export (a server holding the rows would grow by at least that).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_api import MT10, create_database, drop_database, serve  # noqa: E402
from benchmarks.registry import get_suite  # noqa: E402
from services.store import migrate  # noqa: E402
from services.store.api_keys import create_api_key  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402


def fill(database_url: str, episodes: int) -> float:
    engine = create_db_engine(url=database_url)
    tasks_json = "[" + ", ".join(f'"{t}"' for t in MT10) + "]"
    tasks_array = "ARRAY[" + ", ".join(f"'{t}'" for t in MT10) + "]"
    per_task = episodes // len(MT10)
    start = time.perf_counter()
    with engine.begin() as connection:
        connection.execute(text("SELECT setseed(0.5)"))
        connection.execute(text(f"""
            INSERT INTO policies (name, version, endpoint, checkpoint_sha256, state_dim, action_dim, chunk_size,
                                  tasks, created_at)
            VALUES ('big', 'v1', 'ws://gpu-1:8000/ws', '{"ab" * 32}', 39, 4, 4, '{tasks_json}'::jsonb, now())"""))
        connection.execute(text(f"""
            INSERT INTO evaluations (policy_id, suite, tasks, episodes_per_task, seed, standard, status,
                                     episodes_total, definition_hash, created_at, started_at, finished_at)
            VALUES (1, 'metaworld-mt10', '{tasks_json}'::jsonb, {per_task}, 0, true, 'finished',
                    {per_task * len(MT10)}, '{get_suite("metaworld-mt10").definition_hash()}', now(), now(), now())"""))
        connection.execute(text(f"""
            INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, success,
                                  total_return, steps, duration_s, latency_mean_ms, latency_p95_ms, failure_reason,
                                  error_message, simulator_versions, attempts, worker_id, worker_host, renderer,
                                  created_at, started_at, finished_at)
            SELECT 1, i, ({tasks_array})[i / {per_task} + 1], 1000000 + i % {per_task}, 500,
                   CASE WHEN r < 0.6 THEN 'succeeded' ELSE 'failed' END, r < 0.6, 10 * r,
                   CASE WHEN r < 0.6 THEN 40 + (r * 400)::int ELSE 500 END, 1 + 20 * r, 8 + 10 * r, 15 + 30 * r,
                   CASE WHEN r > 0.995 THEN 'env_error' END,
                   CASE WHEN r > 0.995 THEN 'MuJoCo said "bad qpos", then stopped' END,
                   '{{"metaworld": "3.1.1", "mujoco": "3.3.0"}}'::jsonb, 1, 'worker-' || (i % 32) || '@gpu-7',
                   'gpu-7', 'egl', now(), now(), now()
            FROM (SELECT i, random() AS r FROM generate_series(0, {per_task * len(MT10) - 1}) AS i) AS draws"""))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text("VACUUM ANALYZE"))
    engine.dispose()
    return time.perf_counter() - start


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def stream(base: str, key: str, export_format: str, pid: int) -> dict[str, float]:
    baseline = rss_kib(pid)
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_kib(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rows = size = 0
    first_byte = None
    start = time.perf_counter()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        with client.stream("GET", "/evaluations/1/episodes", params={"format": export_format}) as response:
            assert response.status_code == 200, response.read()[:300]
            for chunk in response.iter_bytes():
                if first_byte is None:
                    first_byte = time.perf_counter() - start
                size += len(chunk)
                rows += chunk.count(b"\n")
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    if export_format == "csv":
        rows -= 1  # the header
    return {"rows": rows, "bytes": size, "seconds": elapsed, "first_byte_s": first_byte or 0.0,
            "baseline_mib": baseline / 1024, "peak_mib": peak / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--formats", default="jsonl,csv")
    args = parser.parse_args()

    database_url = create_database()
    proc = None
    try:
        migrate.upgrade(database_url)
        setup_s = fill(database_url, args.episodes)
        engine = create_db_engine(url=database_url)
        with make_session_factory(engine)() as session:
            _, key = create_api_key(session, "bench")
        engine.dispose()
        proc, base = serve(database_url, "episodes-bench-export")
        pid = proc.pid
        assert pid is not None
        results = {}
        for export_format in args.formats.split(","):
            results[export_format] = stream(base, key, export_format, pid)
        hwm = rss_kib(pid, "VmHWM") / 1024

        print(f"\nEvalForge export benchmark — PostgreSQL, one evaluation of {args.episodes:,} episodes "
              f"(inserted in {setup_s:.0f} s)")
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
              "server: one uvicorn process (`evalforge api`); client: httpx, streamed to nothing\n")
        print("| format | rows | MiB sent | first byte s | total s | rows/s | API RSS before MiB | "
              "API RSS peak MiB | peak − before MiB | peak growth / export size |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for export_format, r in results.items():
            growth = r["peak_mib"] - r["baseline_mib"]
            print(f"| {export_format} | {r['rows']:,} | {r['bytes'] / 2**20:,.0f} | {r['first_byte_s']:.2f} | "
                  f"{r['seconds']:.1f} | {r['rows'] / r['seconds']:,.0f} | {r['baseline_mib']:.0f} | "
                  f"{r['peak_mib']:.0f} | {growth:.0f} | {growth / (r['bytes'] / 2**20):.3f} |")
        print(f"\nAPI process VmHWM (peak RSS over its life, incl. both exports): {hwm:.0f} MiB")
    finally:
        if proc is not None:
            proc.stop()
        drop_database(database_url)


if __name__ == "__main__":
    main()
