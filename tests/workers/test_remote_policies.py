"""Evaluating policies we did not serve: openpi's own `WebsocketPolicyServer` (PyPI openpi-server) and a
vla-eval `PredictModelServer` (PyPI vla-eval), each serving MetaWorld reach's scripted expert written as
their kind of policy, registered through the API (its real handshake reader) and played by the workers'
runner on PostgreSQL; then the inference settings on the same policy and seeds, and broken servers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from websockets.asyncio.server import serve as ws_serve

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.store.api_keys import create_api_key
from services.supervisor import free_port
from services.workers import runner
from tests.eval_api.conftest import RecordingQueue
from tests.protocol.test_adapters import ServerThread
from tests.protocol.test_openpi_adapter import ReachExpertPolicy
from tests.protocol.test_openpi_adapter import serve as serve_openpi
from tests.protocol.test_vla_eval_adapter import ReachExpertServer
from tests.protocol.test_vla_eval_adapter import serve as serve_vla_eval
from tests.workers.conftest import episodes_of, evaluation, fast_settings

pytestmark = pytest.mark.postgres

SUITE, TASK = "metaworld-mt1-reach", "reach-v3"
INSTRUCTION = "reach the goal position"
MAX_STEPS = 150  # the expert reaches the goal in ~40-90 steps


class Api:
    def __init__(self, client: TestClient, key: str, queue: RecordingQueue) -> None:
        self.client, self.queue = client, queue
        self.auth = {"Authorization": f"Bearer {key}"}

    def register(self, expect: int = 201, **body) -> dict:
        response = self.client.post("/policies", json=body, headers=self.auth)
        assert response.status_code == expect, response.text
        return response.json()

    def submit(self, policy_id: int, expect: int = 202, **body) -> dict:
        payload = {"policy_id": policy_id, "suite": SUITE, "episodes_per_task": 2, "seed": 0,
                   "max_steps": MAX_STEPS, **body}
        response = self.client.post("/evaluations", json=payload, headers=self.auth)
        assert response.status_code == expect, response.text
        return response.json()

    def run(self, sessions, evaluation_id: int, **settings) -> list:
        """Play every queued episode of ``evaluation_id`` with the workers' runner, as a worker would."""
        ids = [row.id for row in episodes_of(sessions, evaluation_id)]
        return [runner.run_episode_by_id(sessions, i, "w", fast_settings(**settings)) for i in ids]


@pytest.fixture
def api(pg_engine, sessions) -> Iterator[Api]:
    queue = RecordingQueue()
    app = create_app(ApiSettings(policy_handshake_timeout_s=5.0), engine=pg_engine, episode_queue=queue)
    with sessions() as session:
        _, key = create_api_key(session, "remote-tests")
    with TestClient(app) as client:
        yield Api(client, key, queue)
    runner.close_caches()


def test_an_openpi_server_is_registered_and_evaluated_with_the_mapped_keys(api, sessions):
    policy = ReachExpertPolicy(state_key="observation/joint_position")
    thread, url = serve_openpi(policy, {"policy_name": "pi0-reach", "action_dim": 4})
    try:
        keys = {"state": "observation/joint_position", "images.corner": "observation/exterior_image_1_left"}
        registered = api.register(name="pi0-reach", endpoint=url, protocol="openpi", revision="expert-v1",
                                  observation_keys=keys)
        assert registered["protocol"] == "openpi" and registered["version"] == "expert-v1"
        assert registered["checkpoint_sha256"] is None and registered["task_count"] == 0
        assert registered["action_dim"] == 4 and registered["server_info"]["policy_name"] == "pi0-reach"
        body = api.submit(registered["id"])
        assert body["cameras"] == {"corner": [96, 96]}, "the key map's camera, at the suite's size"
        results = api.run(sessions, body["id"])
        assert [(r.status, r.failure_reason) for r in results] == [("succeeded", None)] * 2, results
    finally:
        thread.stop()
    done = evaluation(sessions, body["id"])
    assert done.finalised and done.success_rate == 1.0
    # Exactly the mapped keys (and the protocol's default for the task: openpi's `prompt`), with the
    # instruction rather than our task name, and the frame at the size the evaluation recorded.
    assert {frozenset(obs) for obs in policy.received} == {
        frozenset({"observation/joint_position", "observation/exterior_image_1_left", "prompt"})}
    first = policy.received[0]
    assert first["prompt"] == INSTRUCTION
    assert first["observation/exterior_image_1_left"].shape == (96, 96, 3)
    assert first["observation/joint_position"].dtype == np.float32


def test_a_vla_eval_server_is_registered_and_evaluated(api, sessions):
    model = ReachExpertServer(chunk_size=4)
    thread, url = serve_vla_eval(model)
    try:
        registered = api.register(name="vla-reach", endpoint=url, protocol="vla-eval", version="v1")
        assert registered["state_dim"] == 39 and registered["action_dim"] == 4
        assert "observation_spec" in registered["server_info"]
        # The server declares a `corner` image in its spec; the evaluation asks for it by name.
        body = api.submit(registered["id"], cameras={"corner": [64, 64]})
        results = api.run(sessions, body["id"])
        assert [(r.status, r.failure_reason) for r in results] == [("succeeded", None)] * 2, results
    finally:
        thread.stop()
    assert {frozenset(obs) for obs in model.received} == {frozenset({"state", "task_description", "images"})}
    assert model.received[0]["task_description"] == INSTRUCTION
    assert set(model.received[0]["images"]) == {"corner"}
    assert len(model.starts) == len(results) and model.ends >= len(results) - 1


def test_a_registration_that_disagrees_with_the_server_is_422_naming_both(api):
    thread, url = serve_vla_eval(ReachExpertServer())
    try:
        error = api.register(expect=422, name="vla", endpoint=url, protocol="vla-eval", version="v1",
                             action_dim=7)["error"]
        assert "action_dim 7" in error["message"] and "server says 4" in error["message"]
        error = api.register(expect=422, name="vla", endpoint=url, protocol="openpi", version="v1")["error"]
        assert error["code"] == "policy_unreachable" and "openpi" in error["message"]
        error = api.register(expect=422, name="bad", endpoint=url, protocol="vla-eval", version="v1",
                             observation_keys={"proprio": "state"})["error"]
        assert error["code"] == "invalid_observation_keys" and "proprio" in error["message"]
        error = api.register(expect=422, name="ours", endpoint=url, observation_keys={"state": "s"})["error"]
        assert error["code"] == "invalid_observation_keys"
    finally:
        thread.stop()


def test_a_suite_the_policy_does_not_fit_is_422_before_any_episode(api, sessions):
    policy = ReachExpertPolicy()
    thread, url = serve_openpi(policy, {})
    try:
        registered = api.register(name="pi0-7d", endpoint=url, protocol="openpi", version="v1", action_dim=7)
        error = api.submit(registered["id"], expect=422)["error"]
        assert error["code"] == "incompatible_policy" and "needs 39/4" in error["message"]
        keyed = api.register(name="pi0-wrist", endpoint=url, protocol="openpi", version="v1",
                             observation_keys={"images.wrist": "observation/wrist_image"})
        error = api.submit(keyed["id"], expect=422)["error"]
        assert error["code"] == "unknown_camera" and "'wrist'" in error["message"]
    finally:
        thread.stop()
    assert api.queue.sent == []


@pytest.mark.parametrize("chunk", [4, 1])
def test_the_action_horizon_changes_what_a_chunked_policy_does_and_nothing_for_a_chunk_of_one(api, sessions,
                                                                                          chunk):
    """The expert's chunk repeats its action ``chunk`` times (a policy planning open-loop): executed whole, the
    arm moves on stale actions; with action_horizon 1 it re-plans every step. With a chunk of one the two
    settings are the same policy, step for step."""
    policy = ReachExpertPolicy(state_key="observation/state", shape_actions=lambda a: np.tile(a, (chunk, 1)))
    thread, url = serve_openpi(policy, {})
    try:
        registered = api.register(name=f"open-loop-{chunk}", endpoint=url, protocol="openpi", version="v1",
                                  chunk_size=chunk)
        whole = api.submit(registered["id"])
        replan = api.submit(registered["id"], inference={"action_horizon": 1})
        assert replan["inference"] == {"action_horizon": 1, "temporal_ensemble": None}
        assert whole["standard"] is False and replan["standard"] is False  # max_steps lowered anyway
        api.run(sessions, whole["id"])
        api.run(sessions, replan["id"])
    finally:
        thread.stop()
    steps = {name: [row.steps for row in episodes_of(sessions, body["id"])]
             for name, body in (("whole", whole), ("replan", replan))}
    if chunk == 1:
        assert steps["whole"] == steps["replan"]
    else:
        assert steps["whole"] != steps["replan"], steps


def _broken_openpi_server(behaviour: str) -> tuple[ServerThread, str]:
    """A raw WebSocket server that misbehaves the way broken openpi servers do."""
    from services.protocol.codec import packb

    port = free_port()

    async def handler(ws) -> None:
        if behaviour == "silent":
            await ws.wait_closed()  # accepts, says nothing, until the client gives up
            return
        await ws.send(packb({}))
        await ws.recv()
        if behaviour == "traceback":
            await ws.send("Traceback (most recent call last):\n  File \"policy.py\", line 3\n"
                          "ValueError: the wrist camera is missing")
            await ws.close()
        elif behaviour == "nan":
            await ws.send(packb({"actions": np.full((4,), np.nan)}))
        elif behaviour == "shape":
            await ws.send(packb({"actions": np.zeros((2, 3, 4))}))
        elif behaviour == "close":
            await ws.close()

    async def main() -> None:
        async with ws_serve(handler, "127.0.0.1", port):
            await asyncio.Future()  # until ServerThread.stop cancels it

    return ServerThread(main).start(), f"ws://127.0.0.1:{port}"


@pytest.mark.parametrize("behaviour, reason, fragment", [
    ("traceback", "policy_error", "ValueError: the wrist camera is missing"),
    ("nan", "policy_error", "invalid_actions"),
    ("shape", "policy_error", "invalid_actions"),
    ("close", "policy_timeout", "after 2 tries"),
])
def test_a_broken_server_fails_the_episode_with_a_clear_reason_and_the_worker_goes_on(api, sessions, behaviour,
                                                                                    reason, fragment):
    thread, url = _broken_openpi_server(behaviour)
    try:
        registered = api.register(name=f"broken-{behaviour}", endpoint=url, protocol="openpi", version="v1")
        body = api.submit(registered["id"], episodes_per_task=1)
        results = api.run(sessions, body["id"], policy_retries=1, policy_connect_deadline_s=1.0,
                          policy_call_timeout_s=2.0, policy_backoff_s=0.05, policy_backoff_max_s=0.1)
    finally:
        thread.stop()
    assert [r.failure_reason for r in results] == [reason], results
    message = episodes_of(sessions, body["id"])[0].error_message
    assert fragment in message
    assert "Traceback" not in message and "policy.py" not in message, "never the traceback itself"
    assert evaluation(sessions, body["id"]).finalised


def test_a_server_that_never_answers_hello_is_refused_at_registration(api):
    thread, url = _broken_openpi_server("silent")
    try:
        error = api.register(expect=422, name="silent", endpoint=url, protocol="vla-eval", version="v1")["error"]
    finally:
        thread.stop()
    assert error["code"] == "policy_unreachable" and "vla-eval" in error["message"]
