"""Worker pools per simulator family: real `evalforge worker` subprocesses on a real Redis and PostgreSQL.

A worker consumes only its families' queues (and the bare one); its heartbeat tells the API it is
live and what it serves; an evaluation no live worker can run stays pending and says so; each
episode records the simulator packages it ran with.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from benchmarks.simulators import simulator_versions
from services.cli.worker import chosen_simulators
from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.queue import CeleryEpisodeQueue
from services.store import queries
from services.store.api_keys import create_api_key
from services.store.models import Worker, utcnow
from tests.eval_api.conftest import RecordingQueue
from tests.workers.conftest import episodes_of, evaluation, make_evaluation, wait_for

pytestmark = pytest.mark.postgres


def _live(sessions) -> dict[str, Worker]:
    with sessions() as session:
        return {w.id.split("@")[0]: w for w in queries.live_workers(session, seen_after=utcnow() - timedelta(seconds=30))}


def test_a_pool_takes_only_its_own_simulators_episodes_and_the_api_says_what_waits(
        sessions, pg_engine, policy_server, redis_server, start_worker):
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)  # metaworld reach
    start_worker(redis_server.url, "pusht-pool", simulators="gym-pusht")
    wait_for(lambda: "pusht-pool" in _live(sessions), 20, "the pusht worker's heartbeat")
    assert set(_live(sessions)["pusht-pool"].simulators) == {"gym-pusht"}
    assert _live(sessions)["pusht-pool"].simulators["gym-pusht"] == simulator_versions("gym-pusht")

    CeleryEpisodeQueue(redis_server.url).enqueue(ids, "metaworld")
    app = create_app(ApiSettings(), engine=pg_engine, episode_queue=RecordingQueue())
    with sessions() as session:
        _, key = create_api_key(session, "pools")
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {key}"}
        time.sleep(3)  # long enough for a pusht worker to have taken a metaworld episode, were it to
        assert [r.status for r in episodes_of(sessions, evaluation_id)] == ["pending", "pending"]
        detail = client.get(f"/evaluations/{evaluation_id}", headers=auth).json()
        assert "no live worker runs simulator metaworld" in detail["waiting_for"]
        assert "--simulators metaworld" in detail["waiting_for"]
        listed = client.get("/workers", headers=auth).json()
        assert [w["simulators"].keys() for w in listed] == [{"gym-pusht": 0}.keys()]

        start_worker(redis_server.url, "metaworld-pool", simulators="metaworld")
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 90, "the metaworld pool to finish it")
        assert client.get(f"/evaluations/{evaluation_id}", headers=auth).json()["waiting_for"] is None
        episodes = client.get(f"/evaluations/{evaluation_id}/episodes", headers=auth).json()["items"]
    rows = episodes_of(sessions, evaluation_id)
    assert all(r.simulator_versions == simulator_versions("metaworld") for r in rows)
    assert {"metaworld", "mujoco"} <= set(rows[0].simulator_versions)
    assert episodes[0]["simulator_versions"] == simulator_versions("metaworld")


def test_the_bare_queue_is_served_by_every_pool(sessions, policy_server, redis_server, start_worker):
    """What an older API enqueued without a family still runs."""
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 1)
    worker = start_worker(redis_server.url, "any-pool", simulators="metaworld")
    CeleryEpisodeQueue(redis_server.url).enqueue(ids)
    wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 60, "the episode on the bare queue")
    worker.stop()
    wait_for(lambda: "any-pool" not in _live(sessions), 20, "a stopped worker to remove its row")


def test_simulators_a_worker_cannot_serve_are_refused_naming_the_fix(monkeypatch):
    assert set(chosen_simulators(None)) >= {"metaworld", "gym-pusht"}
    assert chosen_simulators("metaworld, gym-pusht") == ["metaworld", "gym-pusht"]
    with pytest.raises(ValueError, match="unknown family maniskill.*known: metaworld"):
        chosen_simulators("maniskill")
    import benchmarks.simulators as simulators

    monkeypatch.setitem(simulators.SIMULATOR_PACKAGES, "metaworld", ("metaworld-not-installed",))
    simulators.simulator_versions.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"metaworld not installed.*evalforge\[sim-metaworld\]"):
            chosen_simulators("metaworld")
    finally:
        simulators.simulator_versions.cache_clear()
