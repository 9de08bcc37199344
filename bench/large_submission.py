"""Submitting one large evaluation: the 202, then every episode row, then every message in Redis.

    .venv/bin/python bench/large_submission.py [--episodes 100000] [--rounds 2]
        [--code before=/tmp/old,after=.]

One ``POST /evaluations`` of ``--episodes`` null episodes (``benchmarks/null.py``) against an
``evalforge api`` subprocess on PostgreSQL and Redis, with no worker running, timed from this
process: **202** (the response), **all rows** (``count(*)`` of the evaluation's episode rows
reaches ``--episodes``, polled every 50 ms) and **all messages** (the Redis queue's length
reaches it). Each checkout of ``--code`` (``NAME=PATH``) runs its own API from its own tree
(``PYTHONPATH`` = it, cwd = it) on a scratch database migrated by its own migrations; the trees take
turns (``--rounds``, ABAB), each round's evaluation deleted after it, so a change in the shared
machine's load hits them alike. A ``policy-server --engine null`` answers the registration.

Prints one table; the figures go to docs/benchmarks.md ("Submitting 100,000 episodes").
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import redis
from sqlalchemy import create_engine, text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eval_api import REDIS_URL, create_database, drop_database  # noqa: E402  (bench/eval_api.py)

from services.queue import queue_name  # noqa: E402
from services.supervisor import ChildProcess, PolicyServerProcess, free_port  # noqa: E402

RUN_DIR = REPO / "runs" / "bench-large-submission"
CHECKPOINT = REPO / "runs" / "bench-control-plane" / "null-policy"  # bench/control_plane.py's, made if missing


@dataclass
class Tree:
    """One checkout under test: its API process, database and queue."""

    name: str
    path: Path
    database_url: str = ""
    queue: str = field(default_factory=lambda: f"episodes-ls-{secrets.token_hex(4)}")
    api: ChildProcess | None = None
    base: str = ""
    key: str = ""
    policy_id: int = 0
    runs: list[tuple[float, float, float]] = field(default_factory=list)  # (202, all rows, all messages) s

    def env(self) -> dict[str, str]:
        return {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": REDIS_URL,
                "EVALFORGE_EPISODE_QUEUE": self.queue, "PYTHONPATH": str(self.path), "PYTHONUNBUFFERED": "1"}

    def python(self, code: str) -> str:
        """Run ``code`` with this tree's packages; its stdout."""
        out = subprocess.run([sys.executable, "-c", code], cwd=self.path, env=self.env(), capture_output=True,
                             text=True, check=True, timeout=300)
        return out.stdout.strip()


def parse_code(value: str) -> list[Tree]:
    trees = []
    for item in value.split(","):
        name, _, path = item.partition("=")
        tree = Path(path or ".").resolve()
        if not name or not (tree / "services" / "cli").is_dir():
            raise SystemExit(f"--code {item!r}: write NAME=PATH, PATH a checkout of EvalForge")
        trees.append(Tree(name, tree))
    return trees


def start(tree: Tree, episodes: int, server_url: str) -> None:
    tree.database_url = create_database()
    tree.python("from services.store import migrate; migrate.upgrade()")
    tree.key = tree.python("from services.store.db import create_db_engine, make_session_factory\n"
                           "from services.store.api_keys import create_api_key\n"
                           "with make_session_factory(create_db_engine())() as s: print(create_api_key(s, 'b')[1])")
    port = free_port()
    tree.base = f"http://127.0.0.1:{port}"
    env = {**tree.env(), "EVALFORGE_MAX_EPISODES_PER_EVALUATION": str(episodes),
           "EVALFORGE_MAX_QUEUED_EPISODES": str(10 * episodes)}
    tree.api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--log-level",
                             "warning"], RUN_DIR / f"api-{tree.name}-{port}.log", health=f"{tree.base}/readyz",
                            env=env, cwd=tree.path, startup_timeout_s=90).start().wait_healthy()
    response = httpx.post(f"{tree.base}/policies", json={"name": "null", "endpoint": server_url},
                          headers={"Authorization": f"Bearer {tree.key}"}, timeout=60)
    assert response.status_code in (200, 201), response.text[:500]
    tree.policy_id = response.json()["id"]


def submit_once(tree: Tree, episodes: int, seed: int) -> tuple[float, float, float]:
    broker = redis.Redis.from_url(REDIS_URL)
    key = queue_name("null", tree.queue)
    engine = create_engine(tree.database_url)
    start_t = time.perf_counter()
    response = httpx.post(f"{tree.base}/evaluations", json={"policy_id": tree.policy_id, "suite": "null",
                                                            "episodes_per_task": episodes, "seed": seed},
                          headers={"Authorization": f"Bearer {tree.key}"}, timeout=600)
    accepted = time.perf_counter() - start_t
    assert response.status_code == 202, response.text[:500]
    evaluation_id = response.json()["id"]
    rows_at = messages_at = None
    deadline = time.monotonic() + 900
    with engine.connect() as connection:
        while rows_at is None or messages_at is None:
            now = time.perf_counter() - start_t
            if rows_at is None and connection.execute(text(
                    "SELECT count(*) FROM episodes WHERE evaluation_id = :e"), {"e": evaluation_id}).scalar_one() \
                    >= episodes:
                rows_at = now
            connection.rollback()
            if messages_at is None and broker.llen(key) >= episodes:
                messages_at = now
            if time.monotonic() > deadline:
                raise RuntimeError(f"{tree.name}: not all rows/messages after 900 s")
            time.sleep(0.05)
    broker.delete(key)
    with engine.begin() as connection:  # the next round starts from the same empty store
        connection.execute(text("DELETE FROM evaluations WHERE id = :e"), {"e": evaluation_id})
    engine.dispose()
    return accepted, rows_at, messages_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000, help="episodes of the evaluation (default 100000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the trees, ABAB (default 2)")
    parser.add_argument("--code", default="this=.", help="NAME=PATH,… checkouts to compare (default: this one)")
    args = parser.parse_args()
    trees = parse_code(args.code)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    if not (CHECKPOINT / "policy.json").exists():
        subprocess.run([sys.executable, "-m", "trainer.cli", "init-policy", "--suite", "null", "--out",
                        str(CHECKPOINT), "--force"], cwd=REPO, check=True, capture_output=True)
    server = PolicyServerProcess(CHECKPOINT, "--engine", "null", "--log-level", "warning", log_dir=RUN_DIR)
    loads = []
    try:
        server.start()
        for tree in trees:
            start(tree, args.episodes, server.ws_url)
        for round_ in range(args.rounds):
            for tree in trees:
                loads.append(os.getloadavg()[0])
                tree.runs.append(submit_once(tree, args.episodes, 10_000 * round_))
                a, r, m = tree.runs[-1]
                print(f"round {round_ + 1}, {tree.name}: 202 {a:.2f} s, all rows {r:.2f} s, all messages {m:.2f} s",
                      flush=True)
    finally:
        for tree in trees:
            if tree.api is not None:
                tree.api.stop()
            if tree.database_url:
                drop_database(tree.database_url)
        server.stop()
    print(f"\nSubmitting {args.episodes:,} null episodes (PostgreSQL, Redis, no workers), {args.rounds} rounds; "
          f"machine {platform.machine()}, {os.cpu_count()} cores; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; "
          f"1-min load average {min(loads):.1f}–{max(loads):.1f}\n")
    print("| code | 202 s | all rows exist s | all messages in Redis s |")
    print("|---|---:|---:|---:|")
    for tree in trees:
        cols = list(zip(*tree.runs, strict=True))
        print(f"| {tree.name} | " + " | ".join(", ".join(f"{v:.2f}" for v in col) + f" (median {statistics.median(col):.2f})"
                                           for col in cols) + " |")


if __name__ == "__main__":
    main()
