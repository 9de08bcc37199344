"""``VlaEvalClient`` against vla-eval's own model server (PyPI ``vla-eval``: ``PredictModelServer``
under ``serve_async``) serving MetaWorld reach's scripted expert, written here as a vla-eval model
server that records what it got."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from vla_eval.model_servers.predict import PredictModelServer
from vla_eval.model_servers.serve import serve_async
from vla_eval.protocol.messages import unpack_message
from vla_eval.specs import GRIPPER_CLOSE_POS, IMAGE_RGB, LANGUAGE, POSITION_DELTA, DimSpec
from websockets.exceptions import ConnectionClosedOK

from benchmarks.registry import get_suite
from benchmarks.runner import run_policy_episode
from benchmarks.suite import evaluation_seed
from services.protocol.adapters import make_client
from services.protocol.client import (
    ActionChunkBroker,
    ClientSettings,
    PolicyError,
    PolicyUnavailable,
)
from services.protocol.messages import Observation
from services.protocol.vla_eval import pack_frame
from services.supervisor import free_port
from tests.protocol.test_adapters import ServerThread

SUITE = get_suite("metaworld-mt1-reach")
TASK = "reach-v3"
FAST = ClientSettings(connect_deadline_s=10, call_timeout_s=10, initial_backoff_s=0.01, max_backoff_s=0.1)


class ReachExpertServer(PredictModelServer):
    """MetaWorld reach's expert from the state under ``state_key``; ``actions`` is what ``shape_actions``
    makes of the expert's action (the identity: ``[4]``). Keeps every observation, episode start and
    end, and counts hellos (vla-eval asks ``get_observation_params`` once per hello)."""

    def __init__(self, *, state_key: str = "state", shape_actions: Callable[[np.ndarray], Any] = lambda a: a,
                 chunk_size: int | None = None) -> None:
        super().__init__(chunk_size=chunk_size)
        self.state_key = state_key
        self.shape_actions = shape_actions
        self.received: list[dict[str, Any]] = []
        self.predictions = 0
        self.starts: list[dict[str, Any]] = []
        self.ends = 0
        self.hellos = 0
        self.fail: BaseException | None = None  # raised once, by the next predict
        self.drop_next = False  # end the connection (no answer) at the next observation
        self._expert = SUITE.expert(TASK)

    def predict(self, obs: dict, ctx: Any) -> dict:
        fail, self.fail = self.fail, None
        if fail is not None:
            raise fail
        self.predictions += 1
        action = self._expert({"state": np.asarray(obs[self.state_key], dtype=np.float32), "task": TASK})
        return {"actions": self.shape_actions(np.asarray(action, dtype=np.float64))}

    async def on_observation(self, obs: dict, ctx: Any) -> None:
        self.received.append(obs)
        if self.drop_next:
            self.drop_next = False
            raise ConnectionClosedOK(None, None)  # vla-eval's handler then returns: the connection ends
        await super().on_observation(obs, ctx)

    async def on_episode_start(self, config: dict[str, Any], ctx: Any) -> None:
        self.starts.append(config)
        await super().on_episode_start(config, ctx)

    async def on_episode_end(self, result: dict[str, Any], ctx: Any) -> None:
        self.ends += 1
        await super().on_episode_end(result, ctx)

    def get_observation_params(self) -> dict[str, Any]:
        self.hellos += 1
        return {"send_state": True}

    def get_action_spec(self) -> dict[str, DimSpec]:
        return {"position": POSITION_DELTA, "gripper": GRIPPER_CLOSE_POS}

    def get_observation_spec(self) -> dict[str, DimSpec]:
        return {"state": DimSpec("state", 39, "raw"), "corner": IMAGE_RGB, "language": LANGUAGE}


def serve(model: PredictModelServer) -> tuple[ServerThread, str]:
    port = free_port()
    return ServerThread(lambda: serve_async(model, "127.0.0.1", port)).start(), f"ws://127.0.0.1:{port}"


@pytest.fixture
def expert():
    model = ReachExpertServer()
    thread, url = serve(model)
    yield model, url
    thread.stop()


def reach_observation(cameras: tuple[str, ...] = ()) -> Observation:
    obs = SUITE.make_env(TASK, evaluation_seed(0)).reset(evaluation_seed(0))
    rng = np.random.default_rng(0)
    return Observation(state=obs["state"], task=TASK,
                       images={c: rng.integers(0, 256, (12, 10, 3), dtype=np.uint8) for c in cameras})


def test_hello_becomes_server_info_with_the_declared_specs(expert):
    model, url = expert
    with make_client("vla-eval", url, FAST) as client:
        info = client.info
    assert (info.protocol, info.policy_name, info.action_dim, info.state_dim, info.chunk_size) == (
        "vla-eval", "ReachExpertServer", 4, 39, None)
    assert info.checkpoint_sha256 is None and info.tasks == () and model.hellos == 1
    assert info.raw["observation_params"] == {"send_state": True}
    assert info.raw["action_spec"]["position"] == {"name": "position", "dims": 3, "format": "delta_xyz",
                                                   "range": [-1, 1]}
    assert set(info.raw["observation_spec"]) == {"state", "corner", "language"}


def test_the_server_sees_exactly_the_mapped_keys_with_its_images_decoded(expert):
    model, url = expert
    obs = reach_observation(cameras=("corner", "gripper"))
    with make_client("vla-eval", url, FAST) as client:
        reply = client.infer(obs, episode_id="e1")
    (seen,) = model.received
    assert set(seen) == {"images", "state", "task_description"} and set(seen["images"]) == {"corner", "gripper"}
    for camera in ("corner", "gripper"):
        np.testing.assert_array_equal(seen["images"][camera], obs.images[camera])
    np.testing.assert_array_equal(seen["state"], obs.state)
    assert seen["state"].dtype == np.float32 and seen["task_description"] == TASK
    assert model.starts == [{"task": {"name": TASK}}]
    assert reply.actions.dtype == np.float32 and reply.actions.shape == (1, 4)
    np.testing.assert_allclose(reply.actions[0], SUITE.expert(TASK)({"state": obs.state, "task": TASK}), rtol=1e-6)


def test_images_travel_as_png_like_vla_evals_harness_sends_them():
    image = np.random.default_rng(1).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    frame = pack_frame("observation", {"images": {"corner": image}, "state": np.zeros(3, np.float32)}, seq=4)
    wire = msgpack.unpackb(frame)
    assert wire["payload"]["images"]["corner"]["format"] == "png"
    assert wire["payload"]["state"]["__ndarray__"] is True  # arrays with text keys
    message = unpack_message(frame)  # vla-eval's own decoder
    assert message.seq == 4 and message.type.value == "observation"
    np.testing.assert_array_equal(message.payload["images"]["corner"], image)


def test_observation_keys_remap_what_the_server_gets():
    model = ReachExpertServer(state_key="states")
    thread, url = serve(model)
    try:
        keys = {"state": "states", "task": "prompt", "images.corner": "images.agentview"}
        with make_client("vla-eval", url, FAST, observation_keys=keys) as client:
            client.infer(reach_observation(cameras=("corner",)))
        (seen,) = model.received
        assert set(seen) == {"states", "prompt", "images"} and set(seen["images"]) == {"agentview"}
    finally:
        thread.stop()


def test_a_chunking_server_answers_one_row_per_observation():
    model = ReachExpertServer(chunk_size=5, shape_actions=lambda a: np.stack([a + row for row in range(5)]))
    thread, url = serve(model)
    try:
        obs = reach_observation()
        with make_client("vla-eval", url, FAST) as client:
            rows = [client.infer(obs, episode_id="e1").actions for _ in range(6)]
        assert all(r.shape == (1, 4) and r.dtype == np.float32 for r in rows)
        np.testing.assert_allclose(rows[3][0] - rows[0][0], 3.0, rtol=1e-5)
        assert model.predictions == 2  # five rows from the first chunk, the sixth from a new one
    finally:
        thread.stop()


@pytest.mark.parametrize(("shape_actions", "message"), [
    (lambda a: np.append(a, 0.0), r"shape \[5\]; expected \[chunk, 4\]"),
    (lambda a: np.full(4, np.nan), "NaN or infinity"),
    (lambda a: np.zeros((2, 2, 4)), r"shape \[2, 2, 4\]"),
])
def test_bad_actions_are_invalid_actions(shape_actions, message):
    thread, url = serve(ReachExpertServer(shape_actions=shape_actions))
    try:
        with pytest.raises(PolicyError, match=message) as caught:
            make_client("vla-eval", url, FAST).infer(reach_observation())  # action_dim 4 from the action spec
        assert caught.value.code == "invalid_actions"
    finally:
        thread.stop()


def test_a_model_that_raises_is_a_server_error_and_the_connection_goes_on(expert):
    model, url = expert
    model.fail = ValueError("the corner camera is missing\nat step 0")
    with make_client("vla-eval", url, FAST) as client:
        with pytest.raises(PolicyError) as caught:
            client.infer(reach_observation(), episode_id="e1")
        assert caught.value.code == "server_error"
        assert caught.value.message == "observation_failed: ValueError: the corner camera is missing"
        assert client.infer(reach_observation(), episode_id="e1").actions.shape == (1, 4)
    assert model.hellos == 1 and len(model.starts) == 1


def test_episodes_are_bracketed_by_start_and_end(expert):
    model, url = expert
    obs = reach_observation()
    with make_client("vla-eval", url, FAST) as client:
        client.infer(obs, episode_id="e1")
        client.infer(obs, episode_id="e1", step=1)
        client.reset("e2")
        client.infer(obs, episode_id="e2")
        client.infer(obs, episode_id="e3")  # a new episode id without a reset starts one too
        assert len(model.starts) == 3
    # close() sends the last episode's end and returns; the server thread counts it when it reads it
    deadline = time.monotonic() + 10
    while model.ends < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.ends == 3 and model.hellos == 1


def test_a_connection_closed_mid_episode_is_reconnected_with_hello_start_and_the_observation(expert):
    model, url = expert
    obs = reach_observation()
    with make_client("vla-eval", url, FAST) as client:
        client.infer(obs, episode_id="e1")
        model.drop_next = True
        reply = client.infer(obs, episode_id="e1", step=1)
    assert reply.actions.shape == (1, 4)
    assert model.hellos == 2 and len(model.starts) == 2 and len(model.received) == 3
    np.testing.assert_array_equal(model.received[2]["state"], obs.state)


def test_a_server_gone_mid_episode_is_unavailable():
    thread, url = serve(ReachExpertServer())
    settings = ClientSettings(connect_deadline_s=0.5, call_timeout_s=2, initial_backoff_s=0.01, max_backoff_s=0.05)
    client = make_client("vla-eval", url, settings)
    client.infer(reach_observation(), episode_id="e1")
    thread.stop()
    with pytest.raises(PolicyUnavailable, match="the connection was refused"):
        client.infer(reach_observation(), episode_id="e1")


@pytest.mark.parametrize(("chunk_size", "inferences_per_step"), [(None, 0.25), (4, 1.0)])
def test_an_episode_of_metaworld_reach_through_the_broker(chunk_size, inferences_per_step):
    """A [4, A] chunk: executed by our broker (a server without chunk_size), or handed out one row per
    observation by the server's own buffer (chunk_size 4)."""
    model = ReachExpertServer(chunk_size=chunk_size, shape_actions=lambda a: np.stack([a] * 4))
    thread, url = serve(model)
    try:
        env = SUITE.make_env(TASK, evaluation_seed(1))
        with make_client("vla-eval", url, FAST, action_dim=SUITE.action_dim) as client:
            broker = ActionChunkBroker(client, episode_id="reach-1")
            outcome = run_policy_episode(env, broker.act, seed=evaluation_seed(1))
        assert outcome.success
        assert broker.inferences == len(model.received) == pytest.approx(outcome.steps * inferences_per_step, abs=1)
        assert model.predictions == pytest.approx(outcome.steps / 4, abs=1)
        assert {frozenset(obs) for obs in model.received} == {frozenset({"state", "task_description"})}
    finally:
        thread.stop()
