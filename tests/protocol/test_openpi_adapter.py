"""``OpenPiClient`` against openpi's own ``WebsocketPolicyServer`` (PyPI ``openpi-server``) serving
MetaWorld reach's scripted expert, written here as an openpi policy that records what it got."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from openpi_client.base_policy import BasePolicy
from openpi_server.websocket_policy_server import WebsocketPolicyServer
from websockets.exceptions import ConnectionClosedOK

from benchmarks.registry import get_suite
from benchmarks.runner import run_policy_episode
from benchmarks.suite import evaluation_seed
from services.protocol.adapters import make_client
from services.protocol.client import (
    ActionChunkBroker,
    ClientSettings,
    PolicyError,
    PolicyTimeout,
    PolicyUnavailable,
)
from services.protocol.messages import Observation
from services.supervisor import free_port
from tests.protocol.test_adapters import ServerThread

SUITE = get_suite("metaworld-mt1-reach")
TASK = "reach-v3"
FAST = ClientSettings(connect_deadline_s=10, call_timeout_s=10, initial_backoff_s=0.01, max_backoff_s=0.1)
LIBERO_KEYS = {"images.agentview": "observation/image", "images.wrist": "observation/wrist_image"}


class ReachExpertPolicy(BasePolicy):
    """MetaWorld reach's expert from the state under ``state_key``; ``actions`` is what ``shape_actions``
    makes of the expert's action (the identity: ``[4]``); every observation received is kept."""

    def __init__(self, state_key: str = "observation/state",
                 shape_actions: Callable[[np.ndarray], Any] = lambda action: action) -> None:
        self.state_key = state_key
        self.shape_actions = shape_actions
        self.received: list[dict[str, Any]] = []
        self.fail: BaseException | None = None  # raised once, by the next infer
        self.delay_s = 0.0  # slept once, by the next infer
        self._expert = SUITE.expert(TASK)

    def infer(self, obs: dict) -> dict:
        self.received.append(obs)
        fail, self.fail = self.fail, None
        if fail is not None:
            raise fail
        delay, self.delay_s = self.delay_s, 0.0
        time.sleep(delay)
        action = self._expert({"state": np.asarray(obs[self.state_key], dtype=np.float32), "task": TASK})
        return {"actions": self.shape_actions(np.asarray(action, dtype=np.float64))}


def serve(policy: BasePolicy, metadata: dict | None = None) -> tuple[ServerThread, str]:
    port = free_port()
    server = WebsocketPolicyServer(policy, host="127.0.0.1", port=port, metadata=metadata)
    return ServerThread(server.run).start(), f"ws://127.0.0.1:{port}"


@pytest.fixture
def expert():
    policy = ReachExpertPolicy()
    thread, url = serve(policy, {"policy_name": "reach-expert", "action_dim": 4, "norm_stats": np.ones(4)})
    yield policy, url
    thread.stop()


def reach_observation(cameras: tuple[str, ...] = ()) -> Observation:
    env = SUITE.make_env(TASK, evaluation_seed(0))
    obs = env.reset(evaluation_seed(0))
    rng = np.random.default_rng(0)
    return Observation(state=obs["state"], task=TASK,
                       images={c: rng.integers(0, 256, (12, 10, 3), dtype=np.uint8) for c in cameras})


def test_metadata_frame_becomes_server_info(expert):
    _, url = expert
    with make_client("openpi", url, FAST) as client:
        info = client.info
        assert (info.protocol, info.policy_name, info.action_dim, info.chunk_size, info.checkpoint_sha256) == (
            "openpi", "reach-expert", 4, None, None)
        assert info.raw == {"policy_name": "reach-expert", "action_dim": 4,
                            "norm_stats": {"array": {"shape": [4], "dtype": "<f8"}}}


def test_the_server_sees_exactly_the_mapped_keys_and_answers_a_float32_chunk(expert):
    policy, url = expert
    obs = reach_observation(cameras=("agentview", "wrist"))
    with make_client("openpi", url, FAST, observation_keys=LIBERO_KEYS) as client:
        reply = client.infer(obs, episode_id="e1", step=0)
    (seen,) = policy.received
    assert set(seen) == {"observation/state", "observation/image", "observation/wrist_image", "prompt"}
    np.testing.assert_array_equal(seen["observation/state"], obs.state)
    np.testing.assert_array_equal(seen["observation/image"], obs.images["agentview"])
    np.testing.assert_array_equal(seen["observation/wrist_image"], obs.images["wrist"])
    assert seen["prompt"] == TASK
    assert reply.actions.dtype == np.float32 and reply.actions.shape == (1, 4)  # [A] is a chunk of one
    np.testing.assert_allclose(reply.actions[0], SUITE.expert(TASK)({"state": obs.state, "task": TASK}), rtol=1e-6)
    assert "infer_ms" in reply.timing


def test_a_chunk_comes_back_as_float32_rows():
    policy = ReachExpertPolicy(shape_actions=lambda a: np.stack([a, 2 * a, 3 * a]))
    thread, url = serve(policy)
    try:
        with make_client("openpi", url, FAST) as client:
            assert client.info.action_dim is None and client.info.raw == {}
            actions = client.infer(reach_observation()).actions
        assert actions.dtype == np.float32 and actions.shape == (3, 4)
        np.testing.assert_allclose(actions[2], 3 * actions[0], rtol=1e-6)
    finally:
        thread.stop()


@pytest.mark.parametrize(("shape_actions", "message"), [
    (lambda a: np.append(a, 0.0), r"shape \[5\]; expected \[chunk, 4\]"),
    (lambda a: np.full((2, 4), np.nan), "NaN or infinity"),
    (lambda a: a[None, None], r"shape \[1, 1, 4\]"),
    (lambda a: "left", "are a str"),
])
def test_bad_actions_are_invalid_actions(shape_actions, message):
    thread, url = serve(ReachExpertPolicy(shape_actions=shape_actions))
    try:
        with pytest.raises(PolicyError, match=message) as caught:
            make_client("openpi", url, FAST, action_dim=4).infer(reach_observation())
        assert caught.value.code == "invalid_actions"
    finally:
        thread.stop()


def test_a_policy_that_raises_is_a_server_error_of_one_line_and_the_next_call_reconnects(expert):
    policy, url = expert
    policy.fail = ValueError("the wrist camera is missing")
    with make_client("openpi", url, FAST) as client:
        with pytest.raises(PolicyError) as caught:
            client.infer(reach_observation())
        assert caught.value.code == "server_error"
        assert caught.value.message == "ValueError: the wrist camera is missing"
        assert client.infer(reach_observation()).actions.shape == (1, 4)  # a new connection, the server still up


def test_a_connection_closed_mid_episode_is_reconnected_and_the_observation_resent(expert):
    policy, url = expert
    obs = reach_observation()
    with make_client("openpi", url, FAST) as client:
        client.infer(obs)
        # openpi's handler ends the connection (no reply) when its policy's infer raises ConnectionClosed.
        policy.fail = ConnectionClosedOK(None, None)
        reply = client.infer(obs)
    assert len(policy.received) == 3  # the observation the dropped connection lost was sent again
    np.testing.assert_array_equal(policy.received[2]["observation/state"], obs.state)
    assert reply.actions.shape == (1, 4)


def test_a_reply_after_its_timeout_is_never_taken_for_the_next_calls(expert):
    policy, url = expert
    settings = ClientSettings(connect_deadline_s=10, call_timeout_s=0.3, initial_backoff_s=0.01, max_backoff_s=0.1)
    first, second = reach_observation(), reach_observation()
    second = Observation(state=second.state + np.float32(0.05), task=TASK)
    with make_client("openpi", url, settings) as client:
        policy.delay_s = 1.0
        with pytest.raises(PolicyTimeout):
            client.infer(first)
        reply = client.infer(second)
    expected = SUITE.expert(TASK)({"state": second.state, "task": TASK})
    np.testing.assert_allclose(reply.actions[0], expected, rtol=1e-6)


def test_a_server_gone_mid_episode_is_unavailable():
    thread, url = serve(ReachExpertPolicy())
    settings = ClientSettings(connect_deadline_s=0.5, call_timeout_s=2, initial_backoff_s=0.01, max_backoff_s=0.05)
    client = make_client("openpi", url, settings)
    client.infer(reach_observation())
    thread.stop()
    with pytest.raises(PolicyUnavailable, match="the connection was refused"):
        client.infer(reach_observation())


def test_an_episode_of_metaworld_reach_through_the_broker(expert):
    policy, url = expert
    env = SUITE.make_env(TASK, evaluation_seed(1))
    with make_client("openpi", url, FAST, action_dim=SUITE.action_dim) as client:
        broker = ActionChunkBroker(client, episode_id="reach-1")
        outcome = run_policy_episode(env, broker.act, seed=evaluation_seed(1))
    assert outcome.success and broker.inferences == outcome.steps == len(policy.received)
    assert {frozenset(obs) for obs in policy.received} == {frozenset({"observation/state", "prompt"})}
