"""What the store costs one null episode in a worker: database round trips, CPU and wall time.

Plays ``--episodes`` null episodes (``benchmarks/null.py``, 10 steps) against ``policy-server
--engine null`` through ``services.workers.runner.run_episode_by_id`` in this process — no
broker, no Celery — first one at a time, then ``--threads`` at once (as ``evalforge worker
--episodes-in-flight N`` plays them), on a scratch PostgreSQL database. Counts, per episode,
the pool checkouts (each one pre-pinged when the engine pre-pings), the statements the driver
executes, and the commits and rollbacks (SQLAlchemy engine events), and times the finalisation
check on a 100,000-episode evaluation with one episode finished (``--big``; 0 skips it).
With ``--batch K`` (a tree that has ``runner.run_episode_batch``) the same counts for the batched
path: the episodes played K per call, ``--threads`` calls at once (as a worker plays K-id messages);
``--profile`` adds a cProfile of the batched path in one thread (the top functions by own time).

It runs whatever ``services`` is first on the path, so two trees can be compared side by side:
``PYTHONPATH=/tmp/old .venv/bin/python bench/store_round_trips.py`` against the working tree.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import event

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: another tree named there is the one measured

import services  # noqa: E402
from services.store import migrate, queries  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.models import Episode  # noqa: E402
from services.supervisor import PolicyServerProcess  # noqa: E402
from services.workers import runner  # noqa: E402
from services.workers.settings import WorkerSettings  # noqa: E402

SUITE = TASK = "null"
CHECKPOINT = REPO / "runs" / "bench-control-plane" / "null-policy"  # bench/control_plane.py's


def ensure_null_policy() -> Path:
    if not (CHECKPOINT / "policy.json").exists():
        subprocess.run([sys.executable, "-m", "trainer.cli", "init-policy", "--suite", SUITE, "--out",
                        str(CHECKPOINT), "--force"], cwd=REPO, check=True, capture_output=True)
    return CHECKPOINT


def count_round_trips(engine) -> Counter:
    counts: Counter = Counter()
    lock = threading.Lock()

    def bump(name: str) -> None:
        with lock:
            counts[name] += 1

    event.listen(engine, "before_cursor_execute", lambda *a, **k: bump("statements"))
    event.listen(engine, "commit", lambda *a: bump("commits"))
    event.listen(engine, "rollback", lambda *a: bump("rollbacks"))
    event.listen(engine.pool, "checkout", lambda *a: bump("checkouts"))
    return counts


def evaluation(sessions, policy_id: int, n: int, seed: int) -> list[int]:
    with sessions() as session:
        specs = [queries.EpisodeSpec(task=TASK, seed=seed + i, max_steps=10) for i in range(n)]
        return queries.create_evaluation(session, policy_id=policy_id, suite=SUITE, tasks=[TASK], episodes_per_task=n,
                                         seed=0, max_steps=None, standard=False, tags=[], episodes=specs).episode_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=300, help="episodes per phase (default 300)")
    parser.add_argument("--threads", type=int, default=8, help="episodes at once in the second phase (default 8)")
    parser.add_argument("--big", type=int, default=100_000, help="episodes of the finalisation-check evaluation")
    parser.add_argument("--batch", type=int, default=0, help="also play them K per run_episode_batch (0: skip)")
    parser.add_argument("--profile", action="store_true", help="cProfile the batched path (one thread)")
    args = parser.parse_args()
    # Imported after services: bench/eval_api.py puts this tree first on the path.
    from eval_api import create_database, drop_database  # bench/eval_api.py

    database_url = create_database()
    server = PolicyServerProcess(ensure_null_policy(), "--engine", "null", "--log-level", "warning")
    engine = None
    try:
        server.start()
        migrate.upgrade(database_url)
        engine = create_db_engine(url=database_url)
        sessions = make_session_factory(engine)
        with sessions() as session:
            policy_id = queries.create_policy(session, name="null", version="1", endpoint=server.ws_url,
                                              checkpoint_sha256=None, state_dim=4, action_dim=2, chunk_size=4,
                                              tasks=[TASK]).id
        settings = WorkerSettings(replay_episodes=0)
        ids = evaluation(sessions, policy_id, args.episodes + 1, 0)
        runner.run_episode_by_id(sessions, ids[0], "bench", settings)  # connects, builds the simulator
        counts = count_round_trips(engine)
        walls, cpus = [], []
        for episode_id in ids[1:]:
            start, cpu = time.perf_counter(), time.process_time()
            result = runner.run_episode_by_id(sessions, episode_id, "bench", settings)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            assert result.status == "succeeded" or result.status == "failed", result
        per = {name: value / args.episodes for name, value in counts.items()}

        ids = evaluation(sessions, policy_id, args.episodes, 10**6)
        start, cpu = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(args.threads) as pool:
            results = list(pool.map(lambda i: runner.run_episode_by_id(sessions, i, f"bench-{i % 97}", settings), ids))
        threaded_s, threaded_cpu = time.perf_counter() - start, time.process_time() - cpu
        assert sum(r.finalised for r in results) == 1, "the evaluation must be finalised exactly once"
        runner.close_caches()

        batched = None
        profile_text = ""
        if args.batch:
            k = args.batch
            ids = evaluation(sessions, policy_id, args.episodes, 2 * 10**6)
            chunks = [ids[i:i + k] for i in range(0, len(ids), k)]
            before = dict(counts)
            start, cpu = time.perf_counter(), time.process_time()
            with ThreadPoolExecutor(args.threads) as pool:
                played = [r for rs in pool.map(lambda c: runner.run_episode_batch(sessions, c, "bench-batch",
                                                                                     settings), chunks) for r in rs]
            batch_s, batch_cpu = time.perf_counter() - start, time.process_time() - cpu
            assert sum(r.finalised for r in played) == 1 and {r.status for r in played} <= {"succeeded", "failed"}
            batched = ({name: (counts[name] - before.get(name, 0)) / args.episodes for name in counts},
                       args.episodes / batch_s, batch_cpu / args.episodes * 1e3)
            if args.profile:
                ids = evaluation(sessions, policy_id, args.episodes, 3 * 10**6)
                profiler = cProfile.Profile()
                profiler.enable()
                for i in range(0, len(ids), k):
                    runner.run_episode_batch(sessions, ids[i:i + k], "bench-profile", settings)
                profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
                profile_text = out.getvalue()
            runner.close_caches()

        check_ms = None
        if args.big:
            big = evaluation(sessions, policy_id, args.big, 10**7)
            with sessions() as session:
                queries.finish_episode(session, big[-1], success=True, steps=10)
                big_id = session.get(Episode, big[-1]).evaluation_id
            checks = []
            for _ in range(7):
                begin = time.perf_counter()
                with sessions() as session:
                    assert not queries.finalize_evaluation_if_done(session, big_id)
                checks.append(time.perf_counter() - begin)
            check_ms = statistics.median(checks) * 1e3

        print(f"tree: {Path(services.__file__).resolve().parents[1]}; pool pre-ping: {engine.pool._pre_ping}")
        print("| per episode | checkouts | statements | commits | rollbacks | CPU ms (1 at a time) | wall ms "
              f"(1 at a time) | completions/s ({args.threads} threads) | CPU ms ({args.threads} threads) | "
              "finalisation check, 100k evaluation (ms) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| | {per.get('checkouts', 0):.2f} | {per.get('statements', 0):.2f} | {per.get('commits', 0):.2f} | "
              f"{per.get('rollbacks', 0):.2f} | {statistics.median(cpus) * 1e3:.2f} | "
              f"{statistics.median(walls) * 1e3:.2f} | {args.episodes / threaded_s:.0f} | "
              f"{threaded_cpu / args.episodes * 1e3:.2f} | "
              f"{'—' if check_ms is None else f'{check_ms:.2f}'} |")
        if batched is not None:
            per_batch, rate, cpu_ms = batched
            print(f"| batched, {args.batch} per call | {per_batch.get('checkouts', 0):.2f} | "
                  f"{per_batch.get('statements', 0):.2f} | {per_batch.get('commits', 0):.2f} | "
                  f"{per_batch.get('rollbacks', 0):.2f} | — | — | {rate:.0f} | {cpu_ms:.2f} | — |")
        if profile_text:
            print(f"\ncProfile of the batched path ({args.episodes} episodes, {args.batch} per call, one thread):")
            print(profile_text)
    finally:
        if engine is not None:
            engine.dispose()
        server.stop()
        drop_database(database_url)


if __name__ == "__main__":
    main()
