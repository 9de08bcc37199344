"""The embedded store under the load one laptop makes: 50 submissions at once against a real
uvicorn on SQLite never answer 500; any 503 carries ``Retry-After`` and resubmitting gets all in."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from sqlalchemy import func, select

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.store.api_keys import create_api_key
from services.store.db import create_db_engine, make_session_factory
from services.store.models import Evaluation
from services.supervisor import free_port
from tests.eval_api.conftest import RecordingQueue, ScriptedHandshake, metadata

SUBMISSIONS = 50


@pytest.fixture
def served_sqlite_api(sqlite_url):
    engine = create_db_engine(url=sqlite_url)
    handshake = ScriptedHandshake({"ws://policy.test:8000/ws": metadata()})
    app = create_app(ApiSettings(), engine=engine, episode_queue=RecordingQueue(), handshake=handshake)
    with make_session_factory(engine)() as session:
        _, key = create_api_key(session, "load")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}, engine
    finally:
        server.should_exit = True
        thread.join(10)
        engine.dispose()


def test_fifty_concurrent_submissions_on_sqlite_never_500(served_sqlite_api):
    base, auth, engine = served_sqlite_api
    with httpx.Client(base_url=base, headers=auth, timeout=120) as client:
        policy = client.post("/policies", json={"name": "bc", "endpoint": "ws://policy.test:8000/ws"}).json()
        barrier = threading.Barrier(SUBMISSIONS)

        def submit(i: int) -> httpx.Response:
            barrier.wait()
            return client.post("/evaluations", json={"policy_id": policy["id"], "suite": "metaworld-mt10",
                                                     "episodes_per_task": 2, "seed": i})

        with ThreadPoolExecutor(SUBMISSIONS) as pool:
            responses = list(pool.map(submit, range(SUBMISSIONS)))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {202, 503}, [r.text for r in responses if r.status_code not in (202, 503)]
        retry = [i for i, r in enumerate(responses) if r.status_code == 503]
        assert all(responses[i].headers.get("Retry-After") for i in retry)
        for i in retry:
            again = client.post("/evaluations", json={"policy_id": policy["id"], "suite": "metaworld-mt10",
                                                      "episodes_per_task": 2, "seed": i})
            assert again.status_code == 202, again.text
    with make_session_factory(engine)() as session:
        assert session.scalar(select(func.count()).select_from(Evaluation)) == SUBMISSIONS


def test_a_store_that_cannot_take_more_answers_503_with_retry_after(sqlite_url):
    """Another process holds SQLite's write lock past the busy timeout: 503 + Retry-After, then 202."""
    from fastapi.testclient import TestClient

    from services.store.settings import StoreSettings

    engine = create_db_engine(StoreSettings(database_url=sqlite_url, sqlite_busy_timeout_s=0.2))
    handshake = ScriptedHandshake({"ws://policy.test:8000/ws": metadata()})
    app = create_app(ApiSettings(), engine=engine, episode_queue=RecordingQueue(), handshake=handshake)
    with make_session_factory(engine)() as session:
        _, key = create_api_key(session, "busy")
    auth = {"Authorization": f"Bearer {key}"}
    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    with TestClient(app) as client:
        policy = client.post("/policies", json={"name": "bc", "endpoint": "ws://policy.test:8000/ws"},
                             headers=auth).json()
        body = {"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 1, "seed": 0}
        blocker.execute("BEGIN IMMEDIATE")
        busy = client.post("/evaluations", json=body, headers=auth)
        blocker.execute("ROLLBACK")
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "store_busy" and busy.headers["Retry-After"] == "2"
        assert "retry" in busy.json()["error"]["message"]
        assert client.post("/evaluations", json=body, headers=auth).status_code == 202
    blocker.close()
    engine.dispose()
