"""Sync and asyncio clients against a loopback server: answers, retries, faults."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import pytest

from services.protocol.client import (
    ActionChunkBroker,
    AsyncActionChunkBroker,
    AsyncPolicyClient,
    ClientSettings,
    PolicyClient,
    PolicyError,
    PolicyTimeout,
    PolicyUnavailable,
    backoff_delays,
)
from services.protocol.codec import ProtocolError
from services.protocol.messages import Observation
from tests.protocol.loopback_server import CHUNK, STATE_DIM, LoopbackPolicyServer, expected_actions

FAST = ClientSettings(connect_deadline_s=5, call_timeout_s=5, initial_backoff_s=0.01, max_backoff_s=0.1)


@pytest.fixture
def server():
    srv = LoopbackPolicyServer().start()
    yield srv
    srv.stop()


def _obs(seed: int, task: str = "reach-v3") -> Observation:
    return Observation(state=np.random.default_rng(seed).standard_normal(STATE_DIM).astype(np.float32), task=task)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sync_client_reads_metadata_and_gets_its_actions(server):
    with PolicyClient(server.url, FAST) as client:
        assert client.metadata.policy_name == "loopback"
        assert client.metadata.chunk_size == CHUNK and client.metadata.tasks == ("reach-v3", "push-v3")
        obs = _obs(1)
        reply = client.infer(obs, episode_id="ep-1", step=0)
        np.testing.assert_array_equal(reply.actions, expected_actions(obs.state))
        assert reply.actions.dtype == np.float32
        assert client.ping() > 0
        client.reset("ep-1")


def test_async_client_multiplexes_concurrent_calls_on_one_connection(server):
    async def main():
        async with AsyncPolicyClient(server.url, FAST) as client:
            observations = [_obs(i) for i in range(64)]
            replies = await asyncio.gather(*(client.infer(o) for o in observations))
            for obs, reply in zip(observations, replies, strict=True):
                np.testing.assert_array_equal(reply.actions, expected_actions(obs.state))

    asyncio.run(main())
    assert server.connections == 1


def test_connect_retries_until_the_server_comes_up():
    port = _free_port()
    srv = LoopbackPolicyServer(port=port)
    threading.Timer(0.5, srv.start).start()
    try:
        with PolicyClient(f"ws://127.0.0.1:{port}", FAST) as client:
            assert client.metadata.policy_name == "loopback"
    finally:
        time.sleep(0.1)
        srv.stop()


def test_no_server_raises_policy_unavailable_after_the_deadline():
    url = f"ws://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(PolicyUnavailable, match=url):
        PolicyClient(url, ClientSettings(connect_deadline_s=0.5, initial_backoff_s=0.01)).connect()
    assert time.monotonic() - start < 3

    async def main():
        await AsyncPolicyClient(url, ClientSettings(connect_deadline_s=0.5, initial_backoff_s=0.01)).connect()

    with pytest.raises(PolicyUnavailable):
        asyncio.run(main())


def test_bad_url_is_a_value_error():
    with pytest.raises(ValueError, match="ws://"):
        PolicyClient("http://127.0.0.1:1", FAST).connect()


def test_call_timeout_raises_and_a_late_reply_does_not_leak_into_the_next_call(server):
    with PolicyClient(server.url, ClientSettings(call_timeout_s=0.2)) as client:
        server.faults.delay_s = 0.6
        with pytest.raises(PolicyTimeout):
            client.infer(_obs(1))
        server.faults.delay_s = 0.0
        time.sleep(0.6)  # the late reply to the first call is now waiting in the socket
        obs = _obs(2)
        np.testing.assert_array_equal(client.infer(obs).actions, expected_actions(obs.state))


def test_async_call_timeout(server):
    async def main():
        async with AsyncPolicyClient(server.url, ClientSettings(call_timeout_s=0.2)) as client:
            server.faults.delay_s = 0.6
            with pytest.raises(PolicyTimeout):
                await client.infer(_obs(1))

    asyncio.run(main())


def test_sync_client_reconnects_after_a_dropped_connection(server):
    with PolicyClient(server.url, FAST) as client:
        server.faults.drop_next = 1
        obs = _obs(3)
        np.testing.assert_array_equal(client.infer(obs).actions, expected_actions(obs.state))
    assert server.connections == 2


def test_async_client_reconnects_after_a_dropped_connection(server):
    async def main():
        async with AsyncPolicyClient(server.url, FAST) as client:
            server.faults.drop_next = 1
            obs = _obs(4)
            np.testing.assert_array_equal((await client.infer(obs)).actions, expected_actions(obs.state))

    asyncio.run(main())
    assert server.connections == 2


def test_error_replies_raise_policy_error_with_the_code(server):
    with PolicyClient(server.url, FAST) as client:
        with pytest.raises(PolicyError, match="unknown task") as info:
            client.infer(_obs(1, task="fly-v3"))
        assert info.value.code == "unknown_task"
        client.infer(_obs(1))  # the connection stays usable

    async def main():
        async with AsyncPolicyClient(server.url, FAST) as client:
            with pytest.raises(PolicyError) as info:
                await client.infer(_obs(1, task="fly-v3"))
            assert info.value.code == "unknown_task"

    asyncio.run(main())


def test_protocol_version_mismatch_is_refused_without_retrying(server):
    server.faults.protocol_version = 99
    start = time.monotonic()
    with pytest.raises(ProtocolError, match="version 99"):
        PolicyClient(server.url, ClientSettings(connect_deadline_s=30)).connect()
    assert time.monotonic() - start < 5
    assert server.connections == 1


def test_text_frame_from_server_is_a_protocol_error(server):
    with PolicyClient(server.url, FAST) as client:
        server.faults.text_frame_next = True
        with pytest.raises(ProtocolError, match="text frame"):
            client.infer(_obs(1))


def test_chunk_broker_infers_once_per_chunk_and_replays_rows_in_order(server):
    with PolicyClient(server.url, FAST) as client:
        broker = ActionChunkBroker(client, episode_id="ep")
        obs = _obs(5)
        rows = [broker.act(obs) for _ in range(10)]
        assert broker.inferences == 3  # ceil(10 / CHUNK)
        expected = expected_actions(obs.state)
        for i, row in enumerate(rows):
            np.testing.assert_array_equal(row, expected[i % CHUNK])
        assert len(broker.latencies_s) == 3

        receding = ActionChunkBroker(client, actions_per_chunk=2)
        for _ in range(10):
            receding.act(obs)
        assert receding.inferences == 5

        broker.reset("ep-2")
        broker.act(obs)
        assert broker.inferences == 4


def test_async_chunk_broker(server):
    async def main():
        async with AsyncPolicyClient(server.url, FAST) as client:
            broker = AsyncActionChunkBroker(client)
            obs = _obs(6)
            rows = [await broker.act(obs) for _ in range(CHUNK + 1)]
            assert broker.inferences == 2
            np.testing.assert_array_equal(rows[CHUNK], expected_actions(obs.state)[0])

    asyncio.run(main())


def test_backoff_is_exponential_with_full_jitter_and_capped():
    import random

    delays = backoff_delays(0.1, 1.0, random.Random(0))
    samples = [next(delays) for _ in range(10)]
    for n, delay in enumerate(samples):
        assert 0 <= delay <= min(1.0, 0.1 * 2**n)
    assert len(set(samples)) == len(samples)


# ---------------------------------------------------------------------------- endpoints that are not policy servers


SECRET = "s3cr3t-token-6f1d"


class _WebService:
    """A plain HTTP service on 127.0.0.1 that answers every request with ``status`` (and ``headers``), a
    body holding a secret, and counts the requests it got."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        service = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                service.requests += 1
                body = json.dumps({"internal_secret": SECRET}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Internal-Token", SECRET)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"ws://127.0.0.1:{self.http.server_address[1]}/ws"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.parametrize("status", [200, 401, 404])
def test_a_web_service_is_not_retried_and_its_reply_is_never_quoted(status):
    service = _WebService(status)
    try:
        with pytest.raises(PolicyUnavailable) as caught:
            PolicyClient(service.url, ClientSettings(connect_deadline_s=30, initial_backoff_s=0.01)).connect()
    finally:
        service.close()
    assert service.requests == 1  # an HTTP answer other than 5xx is final
    assert caught.value.reason == "nothing answered as a policy server"
    assert SECRET not in str(caught.value) and "internal_secret" not in str(caught.value)
    assert str(status) not in str(caught.value).replace(service.url, "")


def test_redirects_are_not_followed(server):
    service = _WebService(302, {"Location": server.url})
    try:
        with pytest.raises(PolicyUnavailable):
            PolicyClient(service.url, FAST).connect()

        async def main():
            await AsyncPolicyClient(service.url, FAST).connect()

        with pytest.raises(PolicyUnavailable):
            asyncio.run(main())
    finally:
        service.close()
    assert server.connections == 0 and service.requests == 2


def test_a_refused_connection_says_so_and_an_unknown_host_is_not_retried():
    url = f"ws://127.0.0.1:{_free_port()}/ws"
    with pytest.raises(PolicyUnavailable, match="the connection was refused") as caught:
        PolicyClient(url, ClientSettings(connect_deadline_s=0.3, initial_backoff_s=0.01)).connect()
    assert caught.value.reason == "the connection was refused"
    with pytest.raises(PolicyUnavailable, match="the host name is unknown") as caught:
        PolicyClient("ws://no-such-host.invalid/ws", ClientSettings(connect_deadline_s=30)).connect()
    assert caught.value.reason == "the host name is unknown"


def test_a_silent_listener_reads_like_a_web_service():
    service = _WebService(200)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent_url = f"ws://127.0.0.1:{silent.getsockname()[1]}/ws"
        quick = ClientSettings(connect_deadline_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.05)
        with pytest.raises(PolicyUnavailable) as from_silent:
            PolicyClient(silent_url, quick).connect()
    try:
        with pytest.raises(PolicyUnavailable) as from_service:
            PolicyClient(service.url, quick).connect()
    finally:
        service.close()
    assert str(from_silent.value).replace(silent_url, "URL") == str(from_service.value).replace(service.url, "URL")


# ---------------------------------------------------------------------------- bounded handshakes, checkpoints


def _wire(**changes):
    wire = {"type": "metadata", "protocol_version": 1, "policy_name": "p", "checkpoint_sha256": "0" * 64,
            "state_dim": STATE_DIM, "action_dim": 3, "chunk_size": CHUNK, "tasks": ["reach-v3"]}
    return {**wire, **changes}


@pytest.mark.parametrize(("changes", "message"), [
    ({"tasks": [f"task-{i}" for i in range(5000)]}, "5000 entries"),
    ({"tasks": ["x" * 201]}, "over 200 characters"),
    ({"policy_name": "p" * 201}, "'policy_name'"),
    ({"checkpoint_sha256": "ABC"}, "not a sha256"),
    ({"checkpoint_sha256": "g" * 64}, "not a sha256"),
    ({"revision": "v1; rm -rf"}, "'revision'"),
    ({"extra": {"pad": "x" * (1024 * 1024)}}, "cap"),
])
def test_oversized_or_malformed_handshakes_are_refused(server, changes, message):
    server.faults.metadata_wire = _wire(**changes)
    with pytest.raises(ProtocolError, match=message):
        PolicyClient(server.url, FAST).connect()
    assert server.connections == 1  # not retried


def test_the_expected_checkpoint_is_checked_at_every_connection(server):
    from services.protocol.client import CheckpointMismatch

    with pytest.raises(CheckpointMismatch) as caught:
        PolicyClient(server.url, FAST, expected_checkpoint="1" * 64).connect()
    assert "1" * 64 in str(caught.value) and "0" * 64 in str(caught.value)

    client = PolicyClient(server.url, FAST, expected_checkpoint="0" * 64)
    client.infer(_obs(1))
    server.faults.checkpoint_sha256 = "2" * 64  # another server behind the same endpoint
    server.faults.drop_next = 1  # … which the client meets when it reconnects
    with pytest.raises(CheckpointMismatch, match="2" * 64):
        client.infer(_obs(2))
    client.close()

    async def main():
        async with AsyncPolicyClient(server.url, FAST, expected_checkpoint="0" * 64) as client:
            await client.infer(_obs(3))

    with pytest.raises(CheckpointMismatch):
        asyncio.run(main())
