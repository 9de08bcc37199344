"""The policy server over real sockets (transformers engine: fast to start).

Every bad input gets an error reply naming the problem, the connection stays
usable, other clients are unaffected; openpi-style clients, HTTP /act, the
stepwise chunk cache, /metrics and draining on SIGTERM.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys

import httpx
import msgpack
import numpy as np
import pytest

from services.protocol.client import AsyncPolicyClient, PolicyClient
from services.protocol.codec import packb, unpackb
from services.protocol.messages import PROTOCOL_VERSION
from tests.policy_server.conftest import (
    ACTION_DIM,
    CHUNK,
    STATE_DIM,
    TASKS,
    RawConnection,
    random_state,
    start_server,
)


@pytest.fixture
def raw(hf_server):
    conn = RawConnection(hf_server.ws_url)
    yield conn
    conn.close()


def test_handshake_announces_the_policy(raw, checkpoint):
    meta = raw.metadata
    assert meta.protocol_version == PROTOCOL_VERSION
    assert (meta.state_dim, meta.action_dim, meta.chunk_size, meta.tasks) == (STATE_DIM, ACTION_DIM, CHUNK, TASKS)
    assert meta.extra["engine"] == "hf"
    assert meta.policy_name == checkpoint.name
    assert meta.cameras == {}  # a state-only policy asks for no images


def test_answers_match_the_reference(hf_server, reference):
    with PolicyClient(hf_server.ws_url) as client:
        for seed in range(3):
            reply = client.infer({"state": random_state(seed), "task": TASKS[seed]})
            np.testing.assert_array_equal(reply.actions, reference(random_state(seed), TASKS[seed]))
            assert reply.timing["engine_ms"] > 0


BAD_INPUTS = {
    "wrong state shape": (dict(state=np.zeros(5, np.float32)), "invalid_observation", r"shape \[39\]"),
    "wrong state dtype": (dict(state=np.zeros(STATE_DIM, np.float64)), "invalid_observation", "float32"),
    "NaN in state": (dict(state=np.full(STATE_DIM, np.nan, np.float32)), "invalid_observation", "NaN"),
    "inf in state": (dict(state=np.full(STATE_DIM, np.inf, np.float32)), "invalid_observation", "infinity"),
    "unknown task": (dict(task="fly-v3"), "unknown_task", "fly-v3"),
    "task not a string": (dict(task=3), "invalid_observation", "'task'"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_observations_get_an_error_naming_the_field_and_the_connection_stays_usable(raw, name):
    changes, code, pattern = BAD_INPUTS[name]
    reply = raw.infer(request_id=7, **changes)
    assert reply["type"] == "error" and reply["code"] == code and reply["request_id"] == 7
    assert __import__("re").search(pattern, reply["message"]), reply["message"]
    assert "Traceback" not in reply["message"]
    assert raw.infer(request_id=8)["type"] == "actions"


@pytest.mark.parametrize(
    "frame, code, pattern",
    [
        (packb({"type": "infer", "request_id": 1}), "bad_request", "missing the 'obs'"),
        (packb({"type": "infer", "obs": {"state": random_state(0), "task": "reach-v3"}}), "bad_request", "request_id"),
        (packb({"type": "infer", "request_id": 1, "protocol_version": 9,
                "obs": {"state": random_state(0), "task": "reach-v3"}}), "protocol_version", "version 9"),
        (packb({"type": "teleport", "request_id": 1}), "unknown_type", "teleport"),
        (b"\xc1\x00garbage", "bad_frame", "malformed"),
        (packb({"a": 1})[:-1], "bad_frame", "malformed"),
        (msgpack.packb({b"__ndarray__": True, b"data": b"\x00", b"dtype": "<f4", b"shape": [1000]}), "bad_frame",
         "needs 4000 bytes"),
        ("{\"type\": \"ping\"}", "bad_frame", "text frames"),
    ],
    ids=["missing obs", "missing request_id", "version mismatch", "unknown type", "garbage", "truncated",
         "shape larger than data", "text frame"],
)
def test_malformed_requests_get_an_error_and_the_connection_stays_usable(raw, frame, code, pattern):
    reply = raw.ask(frame)
    assert reply["type"] == "error" and reply["code"] == code
    assert __import__("re").search(pattern, reply["message"]), reply["message"]
    assert raw.infer(request_id=2)["type"] == "actions"


def test_a_frame_over_the_cap_is_refused(raw):
    reply = raw.ask(b"\x00" * ((1 << 20) + 10))  # the hf server runs with --max-frame-bytes 1 MiB
    assert reply["code"] == "bad_frame" and "cap" in reply["message"]
    assert raw.infer(request_id=3)["type"] == "actions"


def test_one_clients_garbage_does_not_affect_another(hf_server, reference):
    async def good_client():
        async with AsyncPolicyClient(hf_server.ws_url) as client:
            results = []
            for seed in range(5):
                results.append((seed, (await client.infer({"state": random_state(seed), "task": "reach-v3"})).actions))
            return results

    async def bad_client():
        bad = RawConnection(hf_server.ws_url)
        for _ in range(20):
            await asyncio.to_thread(bad.ask, b"\xff\xfe garbage")
        bad.close()

    async def main():
        results, _ = await asyncio.gather(good_client(), bad_client())
        return results

    for seed, actions in asyncio.run(main()):
        np.testing.assert_array_equal(actions, reference(random_state(seed), "reach-v3"))


def test_openpi_style_bare_observation_gets_actions(raw, reference):
    state = random_state(11)
    reply = raw.ask(packb({"state": state, "prompt": "push-v3"}))
    assert set(reply) == {"actions", "server_timing"}
    np.testing.assert_array_equal(reply["actions"], reference(state, "push-v3"))


def test_stepwise_requests_are_served_from_the_chunk_cache(raw, hf_server, reference):
    def cached_total() -> float:
        text = httpx.get(f"{hf_server.http_url}/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("evalforge_policy_cached_actions_total")))

    state = random_state(21)
    chunk = reference(state, "reach-v3")
    before = cached_total()
    rows = []
    for step in range(CHUNK + 1):
        reply = raw.ask(packb({"type": "infer", "request_id": 100 + step, "episode_id": "ep-cache", "step": step,
                               "stepwise": True, "obs": {"state": state, "task": "reach-v3"}}))
        rows.append(reply["actions"])
    for i in range(CHUNK):
        np.testing.assert_array_equal(rows[i], chunk[i])
    np.testing.assert_array_equal(rows[CHUNK], chunk[0])  # used up: re-inferred
    assert cached_total() - before == CHUNK - 1
    assert raw.ask(packb({"type": "reset", "request_id": 5, "episode_id": "ep-cache"}))["type"] == "pong"
    reply = raw.ask(packb({"type": "infer", "request_id": 6, "episode_id": "ep-cache", "stepwise": True,
                           "obs": {"state": state, "task": "reach-v3"}}))
    np.testing.assert_array_equal(reply["actions"], chunk[0])  # reset cleared the cache


def test_http_act_with_msgpack_and_json(hf_server, reference):
    state = random_state(31)
    frame = packb({"type": "infer", "request_id": 1, "obs": {"state": state, "task": "reach-v3"}})
    response = httpx.post(f"{hf_server.http_url}/act", content=frame, headers={"content-type": "application/msgpack"})
    assert response.status_code == 200
    np.testing.assert_array_equal(unpackb(response.content)["actions"], reference(state, "reach-v3"))

    response = httpx.post(f"{hf_server.http_url}/act", json={"state": state.tolist(), "task": "reach-v3"})
    assert response.status_code == 200
    np.testing.assert_allclose(response.json()["actions"], reference(state, "reach-v3"))

    response = httpx.post(f"{hf_server.http_url}/act", json={"state": [1.0], "task": "reach-v3"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_observation"
    response = httpx.post(f"{hf_server.http_url}/act", json={"state": "x"})
    assert response.status_code == 400 and "'state'" in response.json()["error"]["message"]
    response = httpx.post(f"{hf_server.http_url}/act", content=b"\x00" * ((1 << 20) + 1))
    assert response.status_code == 413


def test_metrics_count_requests_and_errors_by_kind(hf_server):
    def counters() -> dict[str, float]:
        text = httpx.get(f"{hf_server.http_url}/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "_created" not in line}

    before = counters()
    conn = RawConnection(hf_server.ws_url)
    conn.infer(request_id=1)
    conn.infer(request_id=2, task="nope")
    conn.ask(packb({"type": "ping", "request_id": 3}))
    conn.ask(b"\xc1")
    after = counters()
    conn.close()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('evalforge_policy_requests_total{type="infer"}') == 2
    assert delta('evalforge_policy_requests_total{type="ping"}') == 1
    assert delta('evalforge_policy_errors_total{code="unknown_task"}') == 1
    assert delta('evalforge_policy_errors_total{code="bad_frame"}') == 1
    assert delta("evalforge_policy_engine_seconds_count") == 1
    assert after["evalforge_policy_open_connections"] >= 1


def test_sigterm_drains_in_flight_requests_then_exits(checkpoint, tmp_path, reference):
    server = start_server(checkpoint, tmp_path, "--engine", "hf")

    async def main():
        async with AsyncPolicyClient(server.ws_url) as client:
            calls = [asyncio.create_task(client.infer({"state": random_state(s), "task": "reach-v3"})) for s in range(24)]
            await asyncio.sleep(0.1)  # requests are queued behind the one-at-a-time engine
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert server.proc.wait(60) == 0
    for seed, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        np.testing.assert_array_equal(result.actions, reference(random_state(seed), "reach-v3"))
    assert "draining" in server.log()


def _policy_server(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.policy_server", *args], capture_output=True, text=True,
                          timeout=120)


def _copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "copy")


def test_a_truncated_model_is_refused_before_serving_in_one_line(checkpoint, tmp_path):
    broken = _copy(checkpoint, tmp_path)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = _policy_server("--checkpoint", str(broken), "--engine", "hf", "--port", "0")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0] and "model.safetensors" in lines[0], result.stderr
    assert "serving" not in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_weights_that_do_not_fit_config_json_are_refused(checkpoint, tmp_path):
    import json
    broken = _copy(checkpoint, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (broken / "config.json").write_text(json.dumps(config))
    result = _policy_server("--checkpoint", str(broken), "--engine", "hf", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert "num_hidden_layers" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["0.5", "1.5", "0"])
def test_kv_cache_gib_must_be_whole_gib(checkpoint, value, capsys):
    from services.policy_server.cli import read_settings
    with pytest.raises(SystemExit) as exit_info:
        read_settings(["--checkpoint", str(checkpoint), "--kv-cache-gib", value])
    assert exit_info.value.code == 2
    assert "--kv-cache-gib" in capsys.readouterr().err
    assert read_settings(["--checkpoint", str(checkpoint), "--kv-cache-gib", "2"]).kv_cache_gib == 2
