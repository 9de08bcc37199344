"""A short version of ``bench/api_load.py``: 10 clients submitting and polling for a few seconds
against a real uvicorn server on PostgreSQL, with Redis as the broker (no workers). No response
is a 5xx and no submission is lost: every 202 has all its episode rows, and every episode id
reached the queue. No timing assertions (the bench reports the latencies)."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import redis
import uvicorn

from bench.api_load import TASKS, lost_submissions, prepare, run_load
from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.queue import CeleryEpisodeQueue
from services.supervisor import free_port
from tests.store.databases import empty_tables, pg_database, pg_engine  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def served_api(pg_database, pg_engine, redis_url):  # noqa: F811
    queue = f"test_load_{secrets.token_hex(4)}"
    key, policy_id = prepare(pg_database)
    app = create_app(ApiSettings(max_queued_episodes=100_000_000), engine=pg_engine,
                     episode_queue=CeleryEpisodeQueue(redis_url, queue))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", key, policy_id, f"{queue}.metaworld"
    finally:
        server.should_exit = True
        thread.join(10)
        redis.Redis.from_url(redis_url).delete(f"{queue}.metaworld")
        empty_tables(pg_engine)


def test_ten_clients_submitting_and_polling_get_no_5xx_and_lose_nothing(served_api, pg_database,  # noqa: F811
                                                                        redis_url):
    base, key, policy_id, queue = served_api
    report = run_load(base, key, policy_id, clients=10, duration_s=4.0, polls=2)
    assert report.server_errors == 0, report.errors
    assert report.accepted, report.statuses
    assert set(report.statuses["POST /evaluations"]) == {202}, report.statuses
    assert set(report.statuses["GET /evaluations/{id}"]) == {200}, report.statuses
    assert lost_submissions(pg_database, report, redis_url=redis_url, queue=queue) == []
    assert len(report.accepted) * TASKS == sum(report.accepted.values())
