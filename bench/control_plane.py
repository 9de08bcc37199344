"""The control plane's ceiling: episode completions/s through API → broker → workers → PostgreSQL.

    .venv/bin/python bench/control_plane.py [--episodes 600] [--workers 1,2,4,8] [--in-flight 1,8]
        [--brokers redis,embedded] [--rounds 2] [--submit 100000] [--episodes-per-message 1]
        [--code before=/tmp/old@1,after=.@16] [--no-step-costs]

Nothing but plumbing: the ``null`` suite (``benchmarks/null.py``: a zero state, 10 steps, a
seeded success) against ``policy-server --engine null`` (zero actions at once, no model), so an
episode is three policy round trips and its bookkeeping — the claim, the job read, the result,
the finalisation check, the broker message.

1. a scratch PostgreSQL database (migrated, dropped at the end), the null policy (``trainer
   init-policy --suite null``, under ``runs/bench-control-plane``), one ``policy-server --engine
   null``, and per broker one ``evalforge api`` subprocess: **redis** (``BENCH_REDIS_URL``, a queue
   name of this run's own) and **embedded** (``EVALFORGE_BROKER_URL=filesystem:///…``, what
   ``evalforge up`` uses without Redis);
2. for every (broker, worker processes W, ``--episodes-in-flight`` N): W ``evalforge worker
   --episodes-in-flight N --simulators null`` subprocesses (log level warning: at info Celery
   writes two lines per task), warmed up by an untrained evaluation of 2·W·N episodes; then
   ``POST /evaluations`` of ``--episodes`` episodes and wait for it to be finalised. The
   configurations take turns (``--rounds`` rounds over all of them, ABAB), so a change in the
   load of the shared machine hits them alike; each cell sums its rounds;
3. completions/s = episodes / (the evaluation's first claim → its last result), from the rows'
   own timestamps, and end to end (``created_at`` → ``finished_at``, with the insert and enqueue);
4. where the time goes: the CPU seconds per episode of each process group over the timed runs
   (workers, API, policy server, the PostgreSQL backends of the scratch database — not the WAL
   writer or checkpointer —, the Redis server; psutil), and, in this process, the
   wall time of each step one at a time (claim + job read, result, finalisation check, publishing
   one message, one policy round trip);
5. ``--code NAME=PATH[@K],…``: the same cells for other checkouts, side by side in one run — each
   tree's own API and workers (started from that tree, ``PYTHONPATH`` = it), taking turns per cell
   (ABAB), ``@K`` its ``EVALFORGE_EPISODES_PER_MESSAGE`` (a tree that predates it ignores it);
   without ``--code``, this checkout at ``--episodes-per-message``;
6. ``--submit K``: one ``POST /evaluations`` of K null episodes on Redis with no worker running:
   the 202's latency and the time until all K messages are in Redis (the queue's length).

Prints one table; the figures go to docs/benchmarks.md ("Control plane").
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
import redis
from sqlalchemy import func, make_url, select
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_api import REDIS_URL, create_database, drop_database  # noqa: E402  (bench/eval_api.py)

from services.queue import CeleryEpisodeQueue, embedded_broker_url, queue_name  # noqa: E402
from services.store import queries  # noqa: E402
from services.store.api_keys import create_api_key  # noqa: E402
from services.store.db import create_db_engine, make_session_factory  # noqa: E402
from services.store.models import Episode, Evaluation  # noqa: E402
from services.supervisor import ChildProcess, PolicyServerProcess, free_port  # noqa: E402

SUITE, TASK = "null", "null"
RUN_DIR = REPO / "runs" / "bench-control-plane"
CHECKPOINT = RUN_DIR / "null-policy"


@dataclass
class Cell:
    """One (broker, workers, in flight) configuration, summed over its rounds."""

    broker: str
    workers: int
    in_flight: int
    code: str = "this"
    episodes: int = 0
    steady_s: float = 0.0  # first claim → last result
    end_to_end_s: float = 0.0  # POST (created_at) → finalised
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    harness_failures: int = 0
    runs: list[tuple[float, float]] = field(default_factory=list)  # (completions/s, CPU ms per episode) per round

    @property
    def rate(self) -> float:
        return self.episodes / self.steady_s if self.steady_s else 0.0

    @property
    def rate_end_to_end(self) -> float:
        return self.episodes / self.end_to_end_s if self.end_to_end_s else 0.0


def ensure_null_policy() -> Path:
    if not (CHECKPOINT / "policy.json").exists():
        subprocess.run([sys.executable, "-m", "trainer.cli", "init-policy", "--suite", SUITE, "--out",
                        str(CHECKPOINT), "--force"], cwd=REPO, check=True, capture_output=True)
    return CHECKPOINT


@dataclass(frozen=True)
class Code:
    """A checkout whose API and workers are measured, and the episodes per message its API sends."""

    name: str
    tree: Path
    episodes_per_message: int


def parse_code(value: str | None, episodes_per_message: int) -> list[Code]:
    if not value:
        return [Code("this", REPO, episodes_per_message)]
    codes = []
    for item in value.split(","):
        name, _, rest = item.partition("=")
        path, _, k = rest.partition("@")
        tree = Path(path or ".").resolve()
        if not name or not (tree / "services" / "cli").is_dir():
            raise SystemExit(f"--code {item!r}: write NAME=PATH[@K], PATH a checkout of EvalForge")
        codes.append(Code(name, tree, int(k) if k else episodes_per_message))
    return codes


class Broker:
    """One broker under test, and the API process (of one checkout) that publishes to it."""

    def __init__(self, kind: str, database_url: str, log_dir: Path, code: Code | None = None) -> None:
        self.kind = kind
        self.code = code or Code("this", REPO, 1)
        self.queue = f"episodes-cp-{secrets.token_hex(4)}"
        self.env = {**os.environ, "DATABASE_URL": database_url, "EVALFORGE_EPISODE_QUEUE": self.queue,
                    "EVALFORGE_REPLAY_EPISODES": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.code.tree),
                    "EVALFORGE_EPISODES_PER_MESSAGE": str(self.code.episodes_per_message)}
        if kind == "redis":
            self.env["REDIS_URL"] = REDIS_URL
            self.url = REDIS_URL
        else:
            self.dir = Path(tempfile.mkdtemp(prefix="evalforge-cp-broker-"))
            self.url = embedded_broker_url(self.dir)
            self.env["EVALFORGE_BROKER_URL"] = self.url
            self.env.pop("REDIS_URL", None)
        self.log_dir = log_dir
        self.api: ChildProcess | None = None
        self.base = ""

    def start_api(self, max_episodes: int) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        env = {**self.env, "EVALFORGE_MAX_EPISODES_PER_EVALUATION": str(max_episodes),
               "EVALFORGE_MAX_QUEUED_EPISODES": str(max(2 * max_episodes, 100_000))}
        self.api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--log-level",
                                 "warning"], self.log_dir / f"api-{self.kind}-{port}.log", health=f"{self.base}/readyz",
                                env=env, cwd=self.code.tree, startup_timeout_s=180).start().wait_healthy()

    def stop(self) -> None:
        if self.api is not None:
            self.api.stop()
        if self.kind == "redis":
            broker = redis.Redis.from_url(REDIS_URL)
            keys = broker.keys(f"*{self.queue}*")
            if keys:
                broker.delete(*keys)


class Fleet:
    """W worker processes with N episodes in flight each on one broker."""

    def __init__(self, broker: Broker, workers: int, in_flight: int) -> None:
        self.processes: list[ChildProcess] = []
        env = {**broker.env, "EVALFORGE_DB_POOL_SIZE": str(in_flight + 2), "EVALFORGE_DB_MAX_OVERFLOW": "2"}
        for i in range(workers):
            log_path = broker.log_dir / f"worker-{broker.kind}-{in_flight}-{i}-{secrets.token_hex(2)}.log"
            process = ChildProcess(
                [sys.executable, "-m", "services.cli", "worker", "--episodes-in-flight", str(in_flight),
                 "--simulators", "null", "--log-level", "warning", "--hostname", f"cp{i}-{in_flight}@%h"],
                log_path, env=env, cwd=broker.code.tree, grace_s=20, startup_timeout_s=180)
            self.processes.append(process.start())

    def shrink(self, workers: int) -> None:
        while len(self.processes) > workers:
            self.processes.pop().stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def stop(self) -> None:
        self.shrink(0)


def cpu_snapshot(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of these processes and their children, now."""
    seen: dict[int, float] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for p in [process, *process.children(recursive=True)]:
                times = p.cpu_times()
                seen[p.pid] = times.user + times.system
        except psutil.Error:
            continue
    return seen


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (a process started in between counts from zero; one that
    ended in between is lost: an undercount, never negative)."""
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


def pids_matching(name: str, needle: str) -> list[int]:
    """Processes called ``name…`` whose command line contains ``needle`` (PostgreSQL backends name their
    database in their title; the Redis server its port)."""
    found = []
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if (p.info["name"] or "").startswith(name) and needle in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def migrate_tree(code: Code, database_url: str) -> None:
    """Bring ``database_url`` to ``code``'s own head with its own migrations (a subprocess in its tree)."""
    subprocess.run([sys.executable, "-c", "from services.store import migrate; migrate.upgrade()"], cwd=code.tree,
                   env={**os.environ, "DATABASE_URL": database_url, "PYTHONPATH": str(code.tree)}, check=True,
                   timeout=300)


def warm_episodes(workers: int, in_flight: int, episodes_per_message: int) -> int:
    """The warm-up evaluation before a timed one: enough messages for every worker's slots twice."""
    return 2 * workers * in_flight * max(episodes_per_message, 4)


def submit(client: httpx.Client, policy_id: int, episodes: int, seed: int) -> int:
    response = client.post("/evaluations", json={"policy_id": policy_id, "suite": SUITE, "episodes_per_task": episodes,
                                                 "seed": seed, "tags": ["bench-control-plane"]})
    assert response.status_code == 202, response.text[:500]
    return response.json()["id"]


def wait_finished(sessions: sessionmaker[Session], evaluation_id: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as session:
            if session.scalar(select(Evaluation.finished_at).where(Evaluation.id == evaluation_id)) is not None:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"evaluation {evaluation_id} did not finish in {timeout_s:.0f} s; worker logs are "
                               f"under {RUN_DIR}")
        time.sleep(0.1)


def timed_run(client: httpx.Client, sessions: sessionmaker[Session], policy_id: int, episodes: int, seed: int,
              groups: dict, into: Cell) -> None:
    before = {name: cpu_snapshot(pids() if callable(pids) else pids) for name, pids in groups.items()}
    evaluation_id = submit(client, policy_id, episodes, seed)
    wait_finished(sessions, evaluation_id, 60 + episodes / 5)
    after = {name: cpu_snapshot(pids() if callable(pids) else pids) for name, pids in groups.items()}
    with sessions() as session:  # named columns only: another checkout's schema may lack this one's others
        evaluation = session.execute(select(Evaluation.created_at, Evaluation.finished_at)
                                     .where(Evaluation.id == evaluation_id)).one()
        first, last, failed = session.execute(
            select(func.min(Episode.started_at), func.max(Episode.finished_at),
                   func.count().filter(Episode.failure_reason.is_not(None)))
            .where(Episode.evaluation_id == evaluation_id)).one()
    into.episodes += episodes
    into.steady_s += (last - first).total_seconds()
    into.end_to_end_s += (evaluation.finished_at - evaluation.created_at).total_seconds()
    into.harness_failures += failed
    spent = 0.0
    for name in groups:
        into.cpu_s[name] += (cpu := cpu_delta(before[name], after[name]))
        spent += cpu
    into.runs.append((episodes / (last - first).total_seconds(), spent / episodes * 1e3))


def step_costs(sessions: sessionmaker[Session], policy_id: int, server_url: str, broker_url: str,
               n: int = 300) -> dict[str, float]:
    """Wall ms of each bookkeeping step, one at a time in this process (no contention)."""
    from services.protocol.client import PolicyClient
    from services.workers import runner

    with sessions() as session:
        specs = [queries.EpisodeSpec(task=TASK, seed=2_000_000 + i, max_steps=10) for i in range(n)]
        created = queries.create_evaluation(session, policy_id=policy_id, suite=SUITE, tasks=[TASK],
                                            episodes_per_task=n, seed=0, max_steps=None, standard=False, tags=[],
                                            episodes=specs)
        evaluation_id, ids = created.evaluation.id, created.episode_ids
    costs: dict[str, list[float]] = defaultdict(list)
    for episode_id in ids:
        start = time.perf_counter()
        with sessions() as session:
            assert queries.claim_episode(session, episode_id, "bench", 60.0, max_attempts=3)
            runner._load_job(session, episode_id)
        costs["claim + job read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        with sessions() as session:
            queries.finish_episode(session, episode_id, success=True, total_return=1.0, steps=10, duration_s=0.001,
                                   simulator_versions={"evalforge": "0"}, worker_host="bench")
            mid = time.perf_counter()
            queries.finalize_evaluation_if_done(session, evaluation_id)
        costs["result write"].append(mid - start)
        costs["finalisation check"].append(time.perf_counter() - mid)
    # The whole episode as a worker thread plays it (claim … finalisation, three policy round trips), without Celery.
    from services.workers.settings import WorkerSettings

    with sessions() as session:
        specs = [queries.EpisodeSpec(task=TASK, seed=3_000_000 + i, max_steps=10) for i in range(n)]
        created = queries.create_evaluation(session, policy_id=policy_id, suite=SUITE, tasks=[TASK],
                                            episodes_per_task=n, seed=0, max_steps=None, standard=False, tags=[],
                                            episodes=specs)
    settings = WorkerSettings(replay_episodes=0)
    runner.run_episode_by_id(sessions, created.episode_ids[0], "bench", settings)  # connects
    for episode_id in created.episode_ids[1:]:
        start, cpu = time.perf_counter(), time.process_time()
        runner.run_episode_by_id(sessions, episode_id, "bench", settings)
        costs["whole episode: run_episode_by_id (wall)"].append(time.perf_counter() - start)
        costs["whole episode: run_episode_by_id (this process's CPU)"].append(time.process_time() - cpu)
    runner.close_caches()
    queue = CeleryEpisodeQueue(broker_url, queue=f"episodes-cp-costs-{secrets.token_hex(3)}")
    start = time.perf_counter()
    queue.enqueue(list(range(n)))
    costs["publish one message (batch of 300)"] = [(time.perf_counter() - start) / n]
    broker = redis.Redis.from_url(broker_url)
    broker.delete(*broker.keys(f"*{queue.queue}*") or [queue.queue])
    client = PolicyClient(server_url)
    obs = {"state": __import__("numpy").zeros(4, dtype="float32"), "task": TASK}
    client.infer(obs)
    for _ in range(n):
        start = time.perf_counter()
        client.infer(obs)
        costs["policy round trip (null engine)"].append(time.perf_counter() - start)
    client.close()
    return {name: statistics.median(values) * 1e3 for name, values in costs.items()}


def measure_submission(broker: Broker, client: httpx.Client, sessions: sessionmaker[Session], policy_id: int,
                       episodes: int) -> tuple[float, float, float]:
    """(seconds to the 202, seconds until every message is in Redis, ms of one finalisation check on it) for
    one evaluation of ``episodes``."""
    store = redis.Redis.from_url(REDIS_URL)
    key = queue_name("null", broker.queue)
    start = time.perf_counter()
    response = client.post("/evaluations", json={"policy_id": policy_id, "suite": SUITE, "episodes_per_task": episodes,
                                                 "seed": 5_000_000, "tags": ["bench-control-plane-submit"]},
                           timeout=600)
    accepted = time.perf_counter() - start
    assert response.status_code == 202, response.text[:500]
    deadline = time.monotonic() + 600
    while store.llen(key) < episodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {store.llen(key)} of {episodes} messages reached Redis in 600 s")
        time.sleep(0.05)
    queued = time.perf_counter() - start
    store.delete(key)
    checks = []
    for _ in range(5):  # what every episode's result pays on an evaluation this large (it counts the live rows)
        begin = time.perf_counter()
        with sessions() as session:
            queries.finalize_evaluation_if_done(session, response.json()["id"])
        checks.append(time.perf_counter() - begin)
    return accepted, queued, statistics.median(checks) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=600, help="episodes per timed evaluation (default 600)")
    parser.add_argument("--workers", default="1,2,4,8", help="worker process counts (default 1,2,4,8)")
    parser.add_argument("--in-flight", default="1,8", help="--episodes-in-flight values (default 1,8)")
    parser.add_argument("--brokers", default="redis,embedded", help="redis, embedded or both (default both)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all configurations (default 2)")
    parser.add_argument("--submit", type=int, default=100_000, help=(
        "episodes of the one submission timed on Redis with no worker running (0: skip; default 100000)"))
    parser.add_argument("--episodes-per-message", type=int, default=1, help=(
        "EVALFORGE_EPISODES_PER_MESSAGE of the API (default 1: one id per message)"))
    parser.add_argument("--code", help=("NAME=PATH[@K],…: checkouts measured side by side, ABAB (their own API and "
                                        "workers; @K their episodes per message); default this checkout"))
    parser.add_argument("--no-step-costs", action="store_true", help="skip the one-step-at-a-time timings")
    args = parser.parse_args()
    codes = parse_code(args.code, args.episodes_per_message)
    workers = sorted({int(w) for w in args.workers.split(",")}, reverse=True)
    in_flight = [int(n) for n in args.in_flight.split(",")]
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    if min(workers) < 1 or min(in_flight) < 1 or not set(brokers) <= {"redis", "embedded"}:
        raise SystemExit("--workers and --in-flight take counts ≥ 1; --brokers takes redis and/or embedded")

    RUN_DIR.mkdir(parents=True, exist_ok=True)
    checkpoint = ensure_null_policy()
    # A scratch database per checkout, migrated by that checkout's own migrations: an API refuses a
    # database at another revision than its head, so two trees cannot share one.
    database_urls = {code.name: create_database() for code in codes}
    redis_port = f":{urlparse(REDIS_URL).port or 6379}"
    server = PolicyServerProcess(checkpoint, "--engine", "null", "--log-level", "warning", log_dir=RUN_DIR)
    live = {(code.name, kind): Broker(kind, database_urls[code.name], RUN_DIR, code) for code in codes
            for kind in brokers}
    cells = {(c.name, b, w, n): Cell(b, w, n, c.name) for c in codes for b in brokers for n in in_flight
             for w in workers}
    submission: tuple[float, float, float] | None = None
    costs: dict[str, float] = {}
    try:
        server.start()
        for code in codes:
            migrate_tree(code, database_urls[code.name])
        engines = {name: create_db_engine(url=url) for name, url in database_urls.items()}
        session_factories = {name: make_session_factory(engine) for name, engine in engines.items()}
        keys = {}
        for name, factory in session_factories.items():
            with factory() as session:  # api_keys has had one shape since migration 0003
                _, keys[name] = create_api_key(session, "bench")
        for broker in live.values():
            broker.start_api(max(args.episodes, args.submit, warm_episodes(max(workers), max(in_flight),
                                                                           broker.code.episodes_per_message)))
        seeds = iter(range(0, 10**9, 10**5))
        policy_ids = {}
        for (name, kind), broker in live.items():
            with httpx.Client(base_url=broker.base, headers={"Authorization": f"Bearer {keys[name]}"},
                              timeout=60) as client:
                response = client.post("/policies", json={"name": f"null-{name}-{kind}", "endpoint": server.ws_url})
                assert response.status_code in (200, 201), response.text[:500]
                policy_ids[(name, kind)] = response.json()["id"]
        for round_ in range(args.rounds):
            for kind in brokers:
                for n in in_flight:
                    for code in codes:  # the checkouts take turns cell by cell (ABAB)
                        broker = live[(code.name, kind)]
                        sessions = session_factories[code.name]
                        database_name = make_url(database_urls[code.name]).database
                        with httpx.Client(base_url=broker.base, headers={"Authorization": f"Bearer {keys[code.name]}"},
                                          timeout=120) as client:
                            fleet = Fleet(broker, max(workers), n)
                            try:
                                for w in workers:  # most first: shrinking the fleet is cheap, growing is not
                                    fleet.shrink(w)
                                    policy_id = policy_ids[(code.name, kind)]
                                    warm = submit(client, policy_id,
                                                  warm_episodes(w, n, code.episodes_per_message), next(seeds))
                                    wait_finished(sessions, warm, 300)
                                    groups = {"workers": fleet.pids(), "API": [broker.api.pid],
                                              "policy server": [server.pid],
                                              "PostgreSQL": lambda name=database_name: pids_matching("postgres",
                                                                                                      name),
                                              "Redis": pids_matching("redis-server", redis_port)}
                                    cell = cells[(code.name, kind, w, n)]
                                    timed_run(client, sessions, policy_id, args.episodes, next(seeds), groups, cell)
                                    rate, cpu = cell.runs[-1]
                                    print(f"round {round_ + 1}: {code.name}, {kind}, {w} workers × {n} in flight: "
                                          f"{rate:.0f} completions/s, {cpu:.1f} CPU ms per episode "
                                          f"(load {os.getloadavg()[0]:.1f})", flush=True)
                            finally:
                                fleet.stop()
        first = codes[0].name
        sessions = session_factories[first]
        if ("redis" in brokers) and not args.no_step_costs:
            costs = step_costs(sessions, policy_ids[(first, "redis")], server.ws_url, REDIS_URL)
        if "redis" in brokers and args.submit:
            with httpx.Client(base_url=live[(first, "redis")].base, headers={"Authorization": f"Bearer {keys[first]}"},
                              timeout=600) as client:
                submission = measure_submission(live[(first, "redis")], client, sessions,
                                                policy_ids[(first, "redis")], args.submit)
        for engine in engines.values():
            engine.dispose()
    finally:
        for broker in live.values():
            broker.stop()
        server.stop()
        for url in database_urls.values():
            drop_database(url)

    load = os.getloadavg()
    print(f"\nControl plane — null suite (10 steps, 3 policy round trips per episode), policy-server --engine null, "
          f"{args.episodes} episodes per run × {args.rounds} rounds")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load "
          f"average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    names = ["workers", "API", "policy server", "PostgreSQL", "Redis"]
    print("| code | episodes per message | broker | worker processes | in flight each | completions/s | "
          "end to end /s | CPU ms per episode: " + " | ".join(names) + " | total | per round (/s, CPU ms) | "
          "harness failures |")
    print("|---|---:|---|---:|---:|---:|---:|" + "---:|" * (len(names) + 1) + "---|---:|")
    order = {code.name: i for i, code in enumerate(codes)}
    by_name = {code.name: code for code in codes}
    for (name, kind, w, n), cell in sorted(cells.items(), key=lambda item: (item[0][1] != "redis", item[0][3],
                                                                              item[0][2], order[item[0][0]])):
        if not cell.episodes:
            continue
        per = {group: cell.cpu_s[group] / cell.episodes * 1e3 for group in names}
        rounds = "; ".join(f"{rate:.0f}, {cpu:.1f}" for rate, cpu in cell.runs)
        print(f"| {name} | {by_name[name].episodes_per_message} | {kind} | {w} | {n} | {cell.rate:.0f} | "
              f"{cell.rate_end_to_end:.0f} | " + " | ".join(f"{per[group]:.1f}" for group in names)
              + f" | {sum(per.values()):.1f} | {rounds} | {cell.harness_failures} |")
    if costs:
        print("\nOne step at a time (median wall ms, this process, Redis and PostgreSQL on loopback):")
        for name, ms in costs.items():
            print(f"- {name}: {ms:.2f} ms")
    if submission is not None:
        print(f"\nSubmitting {args.submit:,} episodes (Redis, no workers): 202 after {submission[0]:.2f} s; all "
              f"{args.submit:,} messages in Redis after {submission[1]:.2f} s; one finalisation check on it (what "
              f"each episode's result pays) {submission[2]:.1f} ms")


if __name__ == "__main__":
    main()
