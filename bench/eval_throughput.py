"""Evaluation throughput: API → Celery → workers → policy server, against `trainer rollout`'s loop.

    .venv/bin/python bench/eval_throughput.py [--episodes 100] [--workers 1,2] [--engine vllm|hf]

One run, one policy server, the same episodes on every path:

1. the policy: the reach fast recipe's checkpoint ``runs/vla-reach-fast/policy``, built
   when missing (``trainer collect-demos … --episodes-per-task 400`` then ``trainer vla
   configs/vla-reach-fast.yaml``, a few minutes on 2 cores), reused otherwise;
2. one ``policy-server`` on it (vLLM engine by default, ``--engine hf`` for transformers);
3. a scratch PostgreSQL database ``evalforge_bench_<random>`` (migrated, dropped at the
   end), Redis DB ``BENCH_REDIS_URL`` (default 13) with a queue name of this run's own,
   and the API as a uvicorn subprocess (``evalforge api``) — the helpers of
   ``bench/eval_api.py``;
4. **sequential**: ``services.workers.rollout.rollout`` (the loop of ``trainer rollout``)
   in this process — episode ``i`` plays ``evaluation_seed(i)``, the task's own step limit
   (or ``--max-steps``);
5. **workers**: for each ``--workers`` count W, W ``evalforge worker --concurrency 1``
   subprocesses on the queue; ``POST /policies`` (once), then ``POST /evaluations`` with
   ``seed`` = the block's first index — episode ``i`` again plays ``evaluation_seed(i)``
   with the same step limit — and wait until the evaluation is finalised. Wall time is
   the evaluation row's ``created_at → finished_at`` (set inside POST and at finalisation).

The paths take turns in blocks of ``--block`` episodes (sequential, 1 worker, 2
workers, then the next block), so a change in the load of a shared machine hits every
path alike; each path's figures are summed over its blocks. Each path first plays a few
untimed warm-up episodes on seeds outside the timed range (the policy server's first
requests, MuJoCo's import and the simulator's construction happen once per process,
not per episode of a long-running fleet); ``trainer rollout`` builds its simulator
inside each timed block, as it does on every call. Replays are off
(``EVALFORGE_REPLAY_EPISODES=0``): the sequential loop renders nothing.

Prints one row per path: workers, episodes, wall s, episodes/min, mean per-episode s
(wall × workers / episodes: worker-seconds per episode), the part of it spent inside
the episode loop (``run_policy_episode``'s own duration) and outside it (claiming, recording,
dispatch), the mean policy-server round trip, overhead vs sequential, success rate; then whether per-seed outcomes (success, and steps) agree
with the sequential path.

Targets: per-episode overhead ≤ 10% over the sequential loop at 1 worker; the success
rates of both paths agree for the same seeds.

**Episodes in flight** (``--in-flight 1,4,8,16``, issue #23): instead of the paths above, one
``evalforge worker --episodes-in-flight N`` process per N, each on a queue of its own, all
against the one vLLM server; every block creates an evaluation of the same evaluation seeds per
N in the store and enqueues it on that N's queue, the N taking turns block by block (ABAB).
Each worker first plays 2·N untimed warm-up episodes (its N simulators built, its N connections
open). Prints episodes/min per N and its ratio to N = 1, the mean episode time and policy round
trip, the server's mean engine batch size during the N's blocks (from its ``/metrics``), and
whether per-seed outcomes agree with N = 1. Target: ≥ 3× the episodes/min of N = 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_api import REDIS_URL, create_database, drop_database, serve  # noqa: E402  (bench/eval_api.py)

from benchmarks.registry import get_suite  # noqa: E402
from benchmarks.suite import evaluation_seed  # noqa: E402
from services.store import migrate  # noqa: E402
from services.store.api_keys import create_api_key  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.models import Episode, Evaluation  # noqa: E402
from services.supervisor import ChildProcess, PolicyServerProcess  # noqa: E402

SUITE, TASK = "metaworld-mt1-reach", "reach-v3"
CHECKPOINT = REPO / "runs/vla-reach-fast/policy"
DEMOS = REPO / "runs/demos/reach-400"
WARMUP_FIRST = 10_000  # warm-up episodes use evaluation seeds from here, far from the timed ones


@dataclass
class PathResult:
    """One path's episodes, accumulated over the blocks."""

    path: str
    workers: int
    wall_s: float = 0.0
    outcomes: dict[int, tuple[bool, int]] = field(default_factory=dict)  # seed → (success, steps)
    in_episode_s: list[float] = field(default_factory=list)  # each episode's own loop time (reset to last step)
    latency_ms: list[float] = field(default_factory=list)  # each episode's mean policy-server round trip
    between_ms: list[float] = field(default_factory=list)  # a worker process's result → its next claim
    around_ms: list[float] = field(default_factory=list)  # claim → result, less the episode loop itself

    @property
    def episodes(self) -> int:
        return len(self.outcomes)

    @property
    def per_episode_s(self) -> float:
        return self.wall_s * self.workers / self.episodes

    @property
    def success_rate(self) -> float:
        return sum(success for success, _ in self.outcomes.values()) / self.episodes


def ensure_policy(checkpoint: Path) -> Path:
    """The reach fast recipe's checkpoint, trained here first if it is missing."""
    if (checkpoint / "policy.json").exists():
        print(f"policy: reusing {checkpoint}")
        return checkpoint
    if checkpoint != CHECKPOINT:
        raise SystemExit(f"--checkpoint {checkpoint} has no policy.json; pass a policy directory, or omit "
                         f"--checkpoint to build the reach fast recipe at {CHECKPOINT}")
    trainer = [sys.executable, "-m", "trainer.cli"]
    if not (DEMOS / "meta").exists():
        print(f"policy: collecting 400 reach demos into {DEMOS} …", flush=True)
        subprocess.run([*trainer, "collect-demos", "--suite", SUITE, "--episodes-per-task", "400", "--out",
                        str(DEMOS)], cwd=REPO, check=True)
    print("policy: training configs/vla-reach-fast.yaml (a few minutes on 2 cores) …", flush=True)
    subprocess.run([*trainer, "vla", "--config", "configs/vla-reach-fast.yaml"], cwd=REPO, check=True)
    return checkpoint


def sequential_block(url: str, first: int, episodes: int, max_steps: int | None, into: PathResult) -> None:
    """``trainer rollout``'s loop on evaluation seeds ``first …``, in this process."""
    from services.workers.rollout import rollout

    start = time.perf_counter()
    results = rollout(url, SUITE, [TASK], episodes, max_steps=max_steps, first_episode=first)
    into.wall_s += time.perf_counter() - start
    into.outcomes.update({r["seed"]: (bool(r["success"]), r["steps"]) for r in results})
    into.in_episode_s += [r["duration_s"] for r in results]
    into.latency_ms += [r["latency_mean_ms"] for r in results]


class WorkerProcess:
    """An ``evalforge worker --concurrency 1`` subprocess on the scratch database and queue."""

    def __init__(self, name: str, database_url: str, queue: str, log_dir: Path) -> None:
        log_path = log_dir / f"worker-{name}.log"
        env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": REDIS_URL, "EVALFORGE_EPISODE_QUEUE": queue,
               "EVALFORGE_REPLAY_EPISODES": "0"}
        self.process = ChildProcess(
            [sys.executable, "-m", "services.cli", "worker", "--concurrency", "1", "--log-level", "info",
             "--hostname", f"bench-{name}@%h"],
            log_path, health=lambda: "ready." in log_path.read_text(errors="replace"), env=env, cwd=REPO,
            startup_timeout_s=120)
        self.process.start().wait_healthy()

    def stop(self) -> None:
        self.process.stop()


class Fleet:
    """Worker processes of concurrency 1 on one queue; ``resize(n)`` starts or stops the last ones.

    A process joins warm: an untimed evaluation of ``2 n`` episodes (warm-up seeds) runs
    first, so its MuJoCo import, simulator and policy-server connection are in place.
    """

    def __init__(self, database_url: str, queue: str, log_dir: Path) -> None:
        self.database_url, self.queue, self.log_dir = database_url, queue, log_dir
        self.processes: list[WorkerProcess] = []
        self.started = 0

    def resize(self, n: int, warm_up: Callable[[int], None]) -> None:
        while len(self.processes) > n:
            self.processes.pop().stop()
        if len(self.processes) < n:
            while len(self.processes) < n:
                self.started += 1
                self.processes.append(WorkerProcess(str(self.started), self.database_url, self.queue,
                                                    self.log_dir))
            warm_up(2 * n)

    def stop(self) -> None:
        while self.processes:
            self.processes.pop().stop()


def run_evaluation(client: httpx.Client, sessions: sessionmaker[Session], policy_id: int, episodes: int,
                   seed: int, max_steps: int | None) -> int:
    """Submit an evaluation of ``episodes`` reach episodes from evaluation seed ``seed`` through the API;
    wait until it is finalised; its id."""
    body = {"policy_id": policy_id, "suite": SUITE, "episodes_per_task": episodes, "seed": seed,
            "tags": ["bench-throughput"]}
    if max_steps is not None:
        body["max_steps"] = max_steps
    response = client.post("/evaluations", json=body)
    assert response.status_code == 202, response.text[:500]
    evaluation_id = response.json()["id"]
    deadline = time.monotonic() + 60 + 30 * episodes
    while True:
        # Poll the store directly (one indexed row), not the API, so waiting costs the measured path nothing.
        with sessions() as session:
            finished = session.scalar(select(Evaluation.finished_at).where(Evaluation.id == evaluation_id))
        if finished is not None:
            return evaluation_id
        if time.monotonic() > deadline:
            raise RuntimeError(f"evaluation {evaluation_id} did not finish in time; worker logs are in the "
                               "benchmark's log directory")
        time.sleep(0.25)


def distributed_block(client: httpx.Client, sessions: sessionmaker[Session], policy_id: int, first: int,
                      episodes: int, max_steps: int | None, into: PathResult) -> None:
    """One evaluation of evaluation seeds ``first …`` through the API and the running fleet."""
    evaluation_id = run_evaluation(client, sessions, policy_id, episodes, first, max_steps)
    with sessions() as session:
        evaluation = session.get(Evaluation, evaluation_id)
        rows = list(session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id)))
    failed = [(r.seed, r.failure_reason, r.error_message) for r in rows if r.failure_reason]
    if failed:
        print(f"warning: {len(failed)} episodes failed for harness reasons, e.g. {failed[:3]}")
    into.wall_s += (evaluation.finished_at - evaluation.created_at).total_seconds()
    into.outcomes.update({r.seed: (bool(r.success), r.steps or 0) for r in rows})
    into.in_episode_s += [r.duration_s or 0.0 for r in rows]
    into.latency_ms += [r.latency_mean_ms or 0.0 for r in rows]
    # Where a worker's time goes outside the episode loop, from the rows' own timestamps
    # (started_at: the claim; finished_at: the result write, before finalisation).
    by_process: dict[str, list[Episode]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r.started_at):
        by_process[row.worker_id].append(row)
    into.between_ms += [(b.started_at - a.finished_at).total_seconds() * 1e3
                        for runs in by_process.values() for a, b in zip(runs, runs[1:], strict=False)]
    into.around_ms += [((r.finished_at - r.started_at).total_seconds() - (r.duration_s or 0.0)) * 1e3
                       for r in rows]


def agreement(reference: PathResult, other: PathResult) -> str:
    seeds = sorted(reference.outcomes)
    same_success = sum(reference.outcomes[s][0] == other.outcomes.get(s, (None, 0))[0] for s in seeds)
    same_steps = sum(reference.outcomes[s] == other.outcomes.get(s) for s in seeds)
    differing = [s - evaluation_seed(0) for s in seeds if reference.outcomes[s] != other.outcomes.get(s)]
    detail = f"; differing episode indices: {differing[:10]}" if differing else ""
    return (f"{other.path} vs sequential: success agrees on {same_success}/{len(seeds)} seeds, success and "
            f"steps on {same_steps}/{len(seeds)}{detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100, help="timed episodes per path (default 100)")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker process counts (default 1,2)")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="policy server engine")
    parser.add_argument("--max-steps", type=int, help="step limit per episode (default: the task's, 500)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="policy (default: the reach fast recipe)")
    parser.add_argument("--block", type=int, default=20, help=(
        "episodes per block; the paths take turns block by block, so a change in machine load hits all of "
        "them alike (default 20)"))
    parser.add_argument("--in-flight", metavar="N[,N...]", help=(
        "compare one worker process at these --episodes-in-flight values (e.g. 1,4,8,16) instead of the "
        "sequential and worker-count paths"))
    args = parser.parse_args()
    if args.episodes < 1 or args.block < 1:
        raise SystemExit("--episodes and --block must be at least 1")
    if args.in_flight:
        from eval_in_flight import in_flight_main  # bench/eval_in_flight.py

        in_flight_main(args)
        return
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise SystemExit(f"--workers {args.workers!r}: give comma-separated counts, e.g. 1,2") from None
    if not worker_counts or min(worker_counts) < 1:
        raise SystemExit(f"--workers {args.workers!r}: every count must be at least 1")

    checkpoint = ensure_policy(args.checkpoint)
    log_dir = REPO / "runs" / "bench-eval-throughput"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = PolicyServerProcess(checkpoint, "--engine", args.engine, "--engine-core", "compute", "--log-level",
                                 "warning", log_dir=log_dir)  # as evalforge up runs it next to workers
    database_url = create_database()
    queue = f"episodes-bench-{secrets.token_hex(4)}"
    api = None
    fleet = Fleet(database_url, queue, log_dir)
    results = [PathResult("sequential (trainer rollout)", 1)]
    results += [PathResult(f"API → Celery → {w} worker process{'es' if w > 1 else ''}", w) for w in worker_counts]
    try:
        started = time.perf_counter()
        server.start()
        print(f"policy server ({args.engine}) ready in {time.perf_counter() - started:.0f} s at {server.ws_url}")
        migrate.upgrade(database_url)
        engine = create_db_engine(url=database_url)
        sessions = make_session_factory(engine)
        with sessions() as session:
            _, key = create_api_key(session, "bench")
        api, base = serve(database_url, queue)

        from services.workers.rollout import rollout

        rollout(server.ws_url, SUITE, [TASK], 2, max_steps=args.max_steps, first_episode=WARMUP_FIRST)
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            response = client.post("/policies", json={"name": "reach-fast", "endpoint": server.ws_url})
            assert response.status_code in (200, 201), response.text[:500]
            policy_id = response.json()["id"]
            warm_seeds = iter(range(WARMUP_FIRST + 100, 10**9, 100))

            def warm_up(episodes: int) -> None:
                run_evaluation(client, sessions, policy_id, episodes, next(warm_seeds), args.max_steps)

            for first in range(0, args.episodes, args.block):
                size = min(args.block, args.episodes - first)
                print(f"block: episodes {first}…{first + size - 1}", flush=True)
                sequential_block(server.ws_url, first, size, args.max_steps, results[0])
                for workers, into in zip(worker_counts, results[1:], strict=True):
                    fleet.resize(workers, warm_up)
                    distributed_block(client, sessions, policy_id, first, size, args.max_steps, into)
        engine.dispose()
    finally:
        fleet.stop()
        if api is not None:
            api.stop()
        server.stop()
        broker = redis.Redis.from_url(REDIS_URL)
        broker.delete(*(broker.keys(f"*{queue}*") or [queue]))
        drop_database(database_url)

    base_result = results[0]
    started = time.perf_counter()
    get_suite(SUITE).make_env(TASK, evaluation_seed(0)).close()
    build_s = time.perf_counter() - started
    load = os.getloadavg()
    print(f"\nEvaluation throughput — {SUITE} ({TASK}), {args.episodes} episodes per path, evaluation seeds "
          f"{evaluation_seed(0)}…{evaluation_seed(args.episodes - 1)}, step limit {args.max_steps or 500}, "
          f"policy server: {args.engine}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)\n")
    print("| path | workers | episodes | wall s | episodes/min | per-episode s | in episode s | outside s | "
          "policy round trip ms | overhead vs sequential | success |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        inside = statistics.fmean(r.in_episode_s)
        overhead = "—" if r is base_result else f"{r.per_episode_s / base_result.per_episode_s - 1:+.1%}"
        print(f"| {r.path} | {r.workers} | {r.episodes} | {r.wall_s:.1f} | {r.episodes / r.wall_s * 60:.1f} | "
              f"{r.per_episode_s:.3f} | {inside:.3f} | {r.per_episode_s - inside:.3f} | "
              f"{statistics.fmean(r.latency_ms):.1f} | {overhead} | "
              f"{r.success_rate:.0%} |")
    print()
    blocks = -(-args.episodes // args.block)
    print(f"sequential: trainer rollout builds its simulator on each call, {build_s:.2f} s here, in each of its "
          f"{blocks} blocks ({build_s * blocks / base_result.episodes * 1e3:.1f} ms per episode)")
    for r in results[1:]:
        print(f"{r.path}: per episode, {statistics.fmean(r.around_ms):.1f} ms from claim to result outside the "
              f"loop (load the job, write the result), {statistics.fmean(r.between_ms):.1f} ms between a "
              f"result and the same process's next claim (finalise check, ack, next message, claim; median "
              f"{statistics.median(r.between_ms):.1f})")
    for r in results[1:]:
        print(agreement(base_result, r))
    if len(results) > 2:
        one = next((r for r in results[1:] if r.workers == 1), None)
        for r in results[1:]:
            if one is not None and r.workers > 1:
                print(f"scaling {r.workers} vs 1 worker: {(r.episodes / r.wall_s) / (one.episodes / one.wall_s):.2f}× "
                      f"episodes/min (ideal {r.workers}×)")


if __name__ == "__main__":
    main()
