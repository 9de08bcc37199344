"""Episodes in flight: ``bench/eval_throughput.py --in-flight 1,4,8,16`` (issue #23).

One ``evalforge worker --episodes-in-flight N`` process per N, each on a queue of its own, all
against one vLLM policy server on the reach fast recipe's checkpoint; the same evaluation seeds
per N, the N taking turns block by block. See ``bench/eval_throughput.py``'s docstring.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from sqlalchemy import select

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_api import REDIS_URL, create_database, drop_database  # noqa: E402  (bench/eval_api.py)
from eval_throughput import SUITE, TASK, WARMUP_FIRST, ensure_policy  # noqa: E402

from benchmarks.suite import evaluation_seed  # noqa: E402
from services.queue import CeleryEpisodeQueue  # noqa: E402
from services.store import migrate, queries  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.models import Episode, Evaluation  # noqa: E402
from services.supervisor import ChildProcess, PolicyServerProcess  # noqa: E402


@dataclass
class Slot:
    """One N: its worker process, its queue, and its figures summed over blocks."""

    n: int
    queue: str
    wall_s: float = 0.0
    outcomes: dict[int, tuple[bool, int]] = field(default_factory=dict)
    episode_s: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    batch_sum: float = 0.0
    batch_count: float = 0.0
    failures: list[tuple] = field(default_factory=list)
    process: ChildProcess | None = None

    @property
    def per_min(self) -> float:
        return len(self.outcomes) / self.wall_s * 60 if self.wall_s else 0.0


def batch_histogram(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the policy server's engine batch-size histogram."""
    text = httpx.get(metrics_url, timeout=10).text
    values = {}
    for name in ("sum", "count"):
        match = re.search(rf"^evalforge_policy_engine_batch_size_{name}\S* (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    return values["sum"], values["count"]


def start_worker(slot: Slot, database_url: str, log_dir: Path) -> None:
    log_path = log_dir / f"worker-inflight-{slot.n}-{secrets.token_hex(2)}.log"
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "EVALFORGE_EPISODE_QUEUE": slot.queue,
           "EVALFORGE_REPLAY_EPISODES": "0", "EVALFORGE_DB_POOL_SIZE": str(slot.n + 2)}
    slot.process = ChildProcess(
        [sys.executable, "-m", "services.cli", "worker", "--episodes-in-flight", str(slot.n), "--simulators",
         "metaworld", "--log-level", "info", "--hostname", f"inflight{slot.n}@%h"],
        log_path, health=lambda: "ready." in log_path.read_text(errors="replace"), env=env, cwd=REPO,
        startup_timeout_s=120).start()
    slot.process.wait_healthy()


def run_block(sessions, policy_id: int, slot: Slot, first: int, episodes: int, max_steps: int | None,
              *, timed: bool, metrics_url: str) -> None:
    limit = max_steps or 500
    specs = [queries.EpisodeSpec(task=TASK, seed=evaluation_seed(first + i), max_steps=limit) for i in range(episodes)]
    before = batch_histogram(metrics_url)
    with sessions() as session:
        created = queries.create_evaluation(session, policy_id=policy_id, suite=SUITE, tasks=[TASK],
                                            episodes_per_task=episodes, seed=first, max_steps=limit, standard=False,
                                            tags=["bench-in-flight"], episodes=specs)
        evaluation_id, ids = created.evaluation.id, created.episode_ids
    CeleryEpisodeQueue(REDIS_URL, queue=slot.queue).enqueue(ids, "metaworld")
    deadline = time.monotonic() + 120 + 30 * episodes
    while True:
        with sessions() as session:
            if session.scalar(select(Evaluation.finished_at).where(Evaluation.id == evaluation_id)) is not None:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"N={slot.n}: evaluation {evaluation_id} did not finish in time")
        time.sleep(0.2)
    if not timed:
        return
    after = batch_histogram(metrics_url)
    with sessions() as session:
        evaluation = session.get(Evaluation, evaluation_id)
        rows = list(session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id)))
    slot.wall_s += (evaluation.finished_at - evaluation.created_at).total_seconds()
    slot.outcomes.update({r.seed: (bool(r.success), r.steps or 0) for r in rows})
    slot.episode_s += [r.duration_s or 0.0 for r in rows]
    slot.latency_ms += [r.latency_mean_ms or 0.0 for r in rows]
    slot.failures += [(r.seed, r.failure_reason) for r in rows if r.failure_reason]
    slot.batch_sum += after[0] - before[0]
    slot.batch_count += after[1] - before[1]


def in_flight_main(args: argparse.Namespace) -> None:
    try:
        values = [int(n) for n in args.in_flight.split(",")]
    except ValueError:
        raise SystemExit(f"--in-flight {args.in_flight!r}: give comma-separated counts, e.g. 1,4,8,16") from None
    if not values or min(values) < 1:
        raise SystemExit("--in-flight: every value must be at least 1")
    checkpoint = ensure_policy(args.checkpoint)
    log_dir = REPO / "runs" / "bench-eval-in-flight"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = PolicyServerProcess(checkpoint, "--engine", args.engine, "--engine-core", "compute", "--log-level",
                                 "warning", log_dir=log_dir)
    database_url = create_database()
    base = f"episodes-inflight-{secrets.token_hex(4)}"
    slots = [Slot(n, f"{base}-n{n}") for n in values]
    try:
        started = time.perf_counter()
        server.start()
        print(f"policy server ({args.engine}) ready in {time.perf_counter() - started:.0f} s at {server.ws_url}",
              flush=True)
        metrics_url = server.ws_url.replace("ws://", "http://").removesuffix("/ws") + "/metrics"
        migrate.upgrade(database_url)
        engine = create_db_engine(url=database_url)
        sessions = make_session_factory(engine)
        from policy_format import checkpoint_digest

        card = __import__("json").loads((checkpoint / "policy.json").read_text())
        with sessions() as session:
            policy = queries.create_policy(session, name="reach-fast", version="v1", endpoint=server.ws_url,
                                           checkpoint_sha256=checkpoint_digest(checkpoint),
                                           state_dim=card["state_dim"], action_dim=card["action_dim"],
                                           chunk_size=card["chunk_size"], tasks=[TASK])
            policy_id = policy.id
        for i, slot in enumerate(slots):
            start_worker(slot, database_url, log_dir)
            run_block(sessions, policy_id, slot, WARMUP_FIRST + 1000 * i, 2 * slot.n, args.max_steps, timed=False,
                      metrics_url=metrics_url)
            print(f"worker with {slot.n} in flight warm", flush=True)
        for first in range(0, args.episodes, args.block):
            size = min(args.block, args.episodes - first)
            print(f"block: episodes {first}…{first + size - 1}", flush=True)
            for slot in slots:
                run_block(sessions, policy_id, slot, first, size, args.max_steps, timed=True, metrics_url=metrics_url)
                print(f"  N={slot.n}: {slot.per_min:.1f} episodes/min so far", flush=True)
        engine.dispose()
    finally:
        for slot in slots:
            if slot.process is not None:
                slot.process.stop()
        server.stop()
        broker = redis.Redis.from_url(REDIS_URL)
        keys = broker.keys(f"*{base}*")
        if keys:
            broker.delete(*keys)
        drop_database(database_url)

    load = os.getloadavg()
    print(f"\nEpisodes in flight — {SUITE} ({TASK}), one worker process per N, {args.episodes} episodes per N in "
          f"blocks of {args.block} (ABAB), evaluation seeds {evaluation_seed(0)}…{evaluation_seed(args.episodes - 1)}, "
          f"step limit {args.max_steps or 500}, policy server: {args.engine}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load average "
          f"at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)\n")
    one = slots[0]
    print("| in flight N | episodes | wall s | episodes/min | vs N=1 | episode s (mean) | policy round trip ms | "
          "engine batch (mean) | success | harness failures |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for slot in slots:
        successes = sum(s for s, _ in slot.outcomes.values())
        batch = slot.batch_sum / slot.batch_count if slot.batch_count else float("nan")
        print(f"| {slot.n} | {len(slot.outcomes)} | {slot.wall_s:.1f} | {slot.per_min:.1f} | "
              f"{slot.per_min / one.per_min:.2f}× | {statistics.fmean(slot.episode_s):.2f} | "
              f"{statistics.fmean(slot.latency_ms):.1f} | {batch:.1f} | {successes / len(slot.outcomes):.0%} | "
              f"{len(slot.failures)} |")
    print()
    for slot in slots[1:]:
        seeds = sorted(one.outcomes)
        same = sum(one.outcomes[s] == slot.outcomes.get(s) for s in seeds)
        same_success = sum(one.outcomes[s][0] == slot.outcomes.get(s, (None, 0))[0] for s in seeds)
        print(f"N={slot.n} vs N={one.n}: success agrees on {same_success}/{len(seeds)} seeds, success and steps on "
              f"{same}/{len(seeds)}")
