"""Fixtures of the worker fault tests: a scratch PostgreSQL database, a dedicated Redis without
persistence, an untrained MetaWorld-reach policy behind a real `policy-server --engine hf`, and
Celery worker subprocesses with short leases."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from services.store import queries
from services.store.db import make_session_factory
from services.store.models import Episode, Evaluation
from services.supervisor import ChildProcess, PolicyServerProcess, free_port
from services.workers.settings import WorkerSettings
from tests.store.databases import empty_tables, pg_database, pg_engine  # noqa: F401  (fixtures)

SUITE, TASK = "metaworld-mt1-reach", "reach-v3"
MAX_STEPS = 8  # two inferences of a 4-action chunk: seconds per episode on a shared CPU
REPO = Path(__file__).resolve().parents[2]

# Short leases and retries, so a fault is noticed within seconds.
FAST = {"lease_s": 3.0, "heartbeat_s": 0.5, "max_attempts": 3, "policy_retries": 2, "policy_backoff_s": 0.2,
        "policy_backoff_max_s": 1.0, "policy_connect_deadline_s": 2.0, "policy_call_timeout_s": 10.0,
        "pending_after_s": 3.0, "sweep_every_s": 0.5, "replay_episodes": 0}


# The checkpoint sha256 make_evaluation registers policies with: the reach checkpoint's once it
# is made (workers check it against the server's handshake), a placeholder before.
REGISTERED_SHA = {"sha256": "ab" * 32}


@pytest.fixture(scope="session")
def reach_checkpoint(tmp_path_factory) -> Path:
    from policy_format import checkpoint_digest
    from trainer.cli import main as trainer_main

    out = tmp_path_factory.mktemp("reach") / "policy"
    trainer_main(["init-policy", "--suite", SUITE, "--out", str(out), "--force"])
    REGISTERED_SHA["sha256"] = checkpoint_digest(out)
    return out


def start_policy_server(checkpoint: Path, log_dir: Path, port: int | None = None) -> PolicyServerProcess:
    server = PolicyServerProcess(checkpoint, "--engine", "hf", log_dir=log_dir)
    if port is not None:
        server.port = port
        server.log_path = log_dir / f"policy-server-{port}-{time.monotonic_ns()}.log"
    return server.start(120)


@pytest.fixture(scope="session")
def policy_server(reach_checkpoint, tmp_path_factory) -> Iterator[PolicyServerProcess]:
    server = start_policy_server(reach_checkpoint, tmp_path_factory.mktemp("policy-logs"))
    yield server
    server.stop()


class RedisServer(ChildProcess):
    """A throwaway `redis-server` without persistence: a restart (``stop`` kills it) loses every queued message."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        super().__init__(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], log_dir / f"redis-{self.port}.log", health=self._listening,
                         startup_timeout_s=10, append_log=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def start(self) -> RedisServer:
        super().start()
        self.wait_healthy(poll_s=0.05)
        return self

    def stop(self) -> int | None:
        return super().stop(signal.SIGKILL)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH: install Redis to run the worker fault tests")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def sessions(pg_engine) -> Iterator[sessionmaker[Session]]:  # noqa: F811
    yield make_session_factory(pg_engine)
    empty_tables(pg_engine)


def fast_settings(**overrides: object) -> WorkerSettings:
    return WorkerSettings(**{**FAST, **overrides})


def make_evaluation(sessions: sessionmaker[Session], endpoint: str, episodes: int, *,
                    max_steps: int = MAX_STEPS, name: str = "reach",
                    checkpoint_sha256: str | None = None,
                    cameras: dict[str, tuple[int, int]] | None = None) -> tuple[int, list[int]]:
    """A policy at ``endpoint`` (registered with ``checkpoint_sha256``, by default the reach
    checkpoint's) and an evaluation of ``episodes`` reach episodes rendering ``cameras`` for it;
    (evaluation id, episode ids)."""
    with sessions() as session:
        policy = queries.find_policy(session, name, "v1") or queries.create_policy(
            session, name=name, version="v1", endpoint=endpoint,
            checkpoint_sha256=checkpoint_sha256 or REGISTERED_SHA["sha256"], state_dim=39,
            action_dim=4, chunk_size=4, tasks=[TASK], cameras=cameras)
        specs = [queries.EpisodeSpec(task=TASK, seed=1_000_000 + i, max_steps=max_steps) for i in range(episodes)]
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite=SUITE, tasks=[TASK], episodes_per_task=episodes, seed=0,
            max_steps=max_steps, standard=False, tags=[], episodes=specs, cameras=cameras)
        return created.evaluation.id, created.episode_ids


def episodes_of(sessions: sessionmaker[Session], evaluation_id: int) -> list[Episode]:
    with sessions() as session:
        return list(session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id)
                                    .order_by(Episode.episode_index)))


def evaluation(sessions: sessionmaker[Session], evaluation_id: int) -> Evaluation:
    with sessions() as session:
        row = session.get(Evaluation, evaluation_id)
        assert row is not None
        return row


def live_count(sessions: sessionmaker[Session], evaluation_id: int) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Episode).where(
            Episode.evaluation_id == evaluation_id, Episode.status.in_(("pending", "running"))))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class WorkerProcess(ChildProcess):
    """An ``evalforge worker`` subprocess, healthy once Celery logs ``ready.``."""

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]


def worker_env(database_url: str, redis_url: str, **overrides: object) -> dict[str, str]:
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    for key, value in {**FAST, **overrides}.items():
        env[f"EVALFORGE_{key.upper()}"] = str(value)
    return env


@pytest.fixture
def start_worker(pg_database, tmp_path) -> Iterator[Callable[..., WorkerProcess]]:  # noqa: F811
    started: list[WorkerProcess] = []

    def start(redis_url: str, name: str = "w1", concurrency: int = 1, simulators: str | None = None,
              **overrides: object) -> WorkerProcess:
        log_path = tmp_path / f"worker-{name}.log"
        worker = WorkerProcess(
            [sys.executable, "-m", "services.cli", "worker", "--concurrency", str(concurrency),
             "--hostname", f"{name}@%h", "--log-level", "info",
             *(["--simulators", simulators] if simulators else [])],
            log_path, health=lambda: "ready." in log_path.read_text(errors="replace"), cwd=REPO,
            env=worker_env(pg_database, redis_url, **overrides), grace_s=15, startup_timeout_s=60)
        started.append(worker)
        worker.start().wait_healthy()
        return worker

    yield start
    for worker in started:
        worker.stop()
