"""Fault test: the database restarts mid-evaluation.

Real processes throughout, on a PostgreSQL server of the test's own (``tests/restartable_postgres``:
``initdb`` + ``pg_ctl`` on a temporary directory and port): the API (``evalforge api``, uvicorn),
an ``evalforge worker`` on a dedicated Redis, `policy-server --engine hf`, and the sweeper in a
thread. The server is stopped (``pg_ctl stop -m fast``: every connection cut) while episodes run,
kept down for several seconds, and started again. While it is down the API answers 503 with the
JSON error shape (``store_unavailable``), workers keep the episodes they are playing and retry
writing their results, the sweeper waits; once it is back the evaluation finishes with every
episode exactly once and nothing failed.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import httpx
import pytest
from sqlalchemy import text

from services.queue import CeleryEpisodeQueue
from services.store import migrate
from services.store.db import create_db_engine, make_session_factory
from services.store.models import EvaluationStatus
from services.supervisor import ChildProcess, free_port, http_status
from services.workers.sweeper import Sweeper
from tests.conftest import REQUIRE_SERVICES
from tests.restartable_postgres import RestartablePostgres, postgres_server_problem
from tests.workers.conftest import (
    REPO,
    WorkerProcess,
    episodes_of,
    evaluation,
    fast_settings,
    make_evaluation,
    wait_for,
    worker_env,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STEPS = 40  # ten inferences: the outage lands mid-episode
COUNT = 8
# Leases longer than the outage: the workers keep their episodes through it (the sweeper has
# nothing to take back), and retry their result writes until the store answers.
SETTINGS = {"lease_s": 60.0, "heartbeat_s": 1.0, "seconds_per_step": 5.0}


@pytest.fixture
def own_postgres():
    problem = postgres_server_problem()
    if problem is not None:
        if REQUIRE_SERVICES:
            pytest.fail(f"EVALFORGE_REQUIRE_SERVICES=1 and {problem}", pytrace=False)
        pytest.skip(problem)
    server = RestartablePostgres().start()
    try:
        migrate.upgrade(server.url)
        yield server
    finally:
        server.destroy()


def _api(url: str, redis_url: str, log_dir) -> ChildProcess:
    port = free_port()
    env = {**worker_env(url, redis_url), "EVALFORGE_DB_CONNECT_TIMEOUT_S": "2", "EVALFORGE_DB_POOL_TIMEOUT_S": "5"}
    api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--log-level", "warning"],
                       log_dir / "api.log", health=lambda: http_status(f"http://127.0.0.1:{port}/healthz") == 200,
                       env=env, cwd=REPO, startup_timeout_s=60)
    api.url = f"http://127.0.0.1:{port}"
    api.start().wait_healthy()
    return api


def test_the_database_restarts_mid_evaluation(own_postgres, policy_server, redis_server, tmp_path, caplog):
    caplog.set_level(logging.WARNING, "evalforge.workers.sweeper")
    engine = create_db_engine(url=own_postgres.url)
    sessions = make_session_factory(engine)
    api = _api(own_postgres.url, redis_server.url, tmp_path)
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(
        [sys.executable, "-m", "services.cli", "worker", "--concurrency", "1", "--hostname", "restart@%h",
         "--log-level", "info"], log_path, health=lambda: "ready." in log_path.read_text(errors="replace"),
        cwd=REPO, env=worker_env(own_postgres.url, redis_server.url, **SETTINGS), grace_s=15, startup_timeout_s=60)
    stop_sweeping = threading.Event()
    sweeper = Sweeper(sessions, CeleryEpisodeQueue(redis_server.url), fast_settings(**SETTINGS))
    sweeping = threading.Thread(target=sweeper.run_forever, kwargs={"stop": stop_sweeping.is_set}, daemon=True)
    try:
        worker.start().wait_healthy()
        evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, COUNT, max_steps=STEPS)
        CeleryEpisodeQueue(redis_server.url).enqueue(ids)
        sweeping.start()
        with httpx.Client(base_url=api.url, timeout=30) as client:
            assert client.get(f"/evaluations/{evaluation_id}").status_code == 200
            wait_for(lambda: sum(r.status in ("succeeded", "failed") for r in episodes_of(sessions, evaluation_id))
                     >= 1 and any(r.status == "running" for r in episodes_of(sessions, evaluation_id)), 90,
                     "an episode to finish and the next to run")

            own_postgres.stop()  # every connection cut, new ones refused
            engine.dispose()  # the test's own pooled connections are dead too
            # Down: JSON 503s that come back (a request that hung would raise httpx's timeout).
            for method, path, body in (("GET", f"/evaluations/{evaluation_id}", None), ("GET", "/policies", None),
                                       ("POST", "/evaluations", {"policy_id": 1, "suite": "metaworld-mt1-reach",
                                                                 "episodes_per_task": 1})):
                response = client.request(method, path, json=body,
                                          headers={"Authorization": "Bearer not-checked-before-the-store"})
                assert response.status_code == 503, (method, path, response.status_code, response.text)
                error = response.json()["error"]
                assert error["code"] == "store_unavailable" and "retry after" in error["message"], error
                assert "Traceback" not in response.text and response.headers["retry-after"].isdigit()
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("error")
            # The worker's episode ends while the store is down: it keeps the result and retries.
            wait_for(lambda: "the store is unreachable" in log_path.read_text(errors="replace"), 120,
                     "the worker to retry writing a result")
            time.sleep(3.0)  # a few sweeps fail meanwhile
            own_postgres.start()

            wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 180, "the evaluation to finish")
            assert client.get(f"/evaluations/{evaluation_id}").status_code == 200
    finally:
        stop_sweeping.set()
        sweeping.join(10)
        worker.stop()
        api.stop()
    worker_log = log_path.read_text(errors="replace")
    assert "written after the store came back" in worker_log, worker_log[-4000:]
    assert any("sweep skipped, the store is unreachable" in r.getMessage() for r in caplog.records), \
        "the sweeper ran while the store was down and waited"
    assert "Traceback" not in api.log(20_000), api.log()
    rows = episodes_of(sessions, evaluation_id)
    assert sorted(r.episode_index for r in rows) == list(range(COUNT))
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None and r.steps == STEPS for r in rows), \
        [(r.episode_index, r.status, r.failure_reason, (r.error_message or "")[:200]) for r in rows]
    assert all(r.attempts == 1 for r in rows), "no episode was taken back and played again"
    with sessions() as session:  # exactly once: one row per index, each written once (a single finish)
        assert session.execute(text("SELECT count(*), count(DISTINCT episode_index) FROM episodes "
                                    "WHERE evaluation_id = :e"), {"e": evaluation_id}).one() == (COUNT, COUNT)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    engine.dispose()


def test_a_claim_waits_for_the_store_to_come_back(own_postgres, policy_server):
    """A worker that receives an episode while the store is down waits for it (its message still
    unacknowledged), then claims and plays the episode: nothing waits for the sweeper."""
    from services.workers import runner

    engine = create_db_engine(url=own_postgres.url)
    sessions = make_session_factory(engine)
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 1)
    own_postgres.stop()
    engine.dispose()
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            own_postgres.start()  # back after two failed claims
        time.sleep(min(seconds, 0.2))

    result = runner.run_episode_by_id(sessions, ids[0], "waiting-worker", fast_settings(**SETTINGS), sleep=sleep)
    assert len(slept) >= 2, "the claim was retried while the store was down"
    assert (result.status in ("succeeded", "failed"), result.failure_reason) == (True, None), result
    row = episodes_of(sessions, evaluation_id)[0]
    assert row.attempts == 1 and row.steps is not None and row.worker_id == "waiting-worker"
    assert evaluation(sessions, evaluation_id).finalised
    engine.dispose()
