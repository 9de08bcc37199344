"""The policy server's ``/vla-eval`` endpoint, driven by the real vla-eval 0.8.0.

One `policy-server --engine hf` serves an untrained `trainer init-policy --suite metaworld-mt1-reach`
checkpoint that declares a 32x32 ``corner`` camera. vla-eval's own runner (`vla-eval run --no-docker`)
evaluates it on ``vla_eval_bench.reach:MetaWorldReach``; the other tests speak the protocol directly,
with vla-eval's own ``pack_message``/``unpack_message`` (PNG images, as its client sends them).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from vla_eval.protocol import numpy_codec
from vla_eval.protocol.messages import (
    Message,
    MessageType,
    make_hello_payload,
    pack_message,
    unpack_message,
)
from vla_eval.specs import DimSpec
from websockets.sync.client import connect

from benchmarks.registry import get_suite
from services.protocol.codec import packb
from tests.policy_server.conftest import RawConnection, start_server
from trainer.cli import main as trainer_main

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).parent / "vla_eval_bench" / "reach.yaml"
SUITE = get_suite("metaworld-mt1-reach")
TASK = SUITE.task_names[0]
INSTRUCTION = SUITE.instruction(TASK)
CHUNK, SIDE = 4, 32
EPISODES, MAX_STEPS = 2, 10  # as reach.yaml says


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "reach-corner"
    trainer_main(["init-policy", "--out", str(out), "--suite", SUITE.name, "--cameras", "corner",
                  "--image-size", str(SIDE), "--chunk-size", str(CHUNK), "--init-std", "0.1", "--force"])
    return out


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"), "--engine", "hf")
    yield server
    server.stop()


class VlaEvalSocket:
    """A WebSocket to ``/vla-eval`` speaking with vla-eval's own message codec."""

    def __init__(self, server) -> None:
        self.ws = connect(f"ws://127.0.0.1:{server.port}/vla-eval", proxy=None, max_size=None, legacy=True)
        self.seq = 0

    def send(self, kind: MessageType, payload: dict) -> int:
        self.seq += 1
        self.ws.send(pack_message(Message(type=kind, payload=payload, seq=self.seq)))
        return self.seq

    def receive(self) -> Message:
        return unpack_message(self.ws.recv(timeout=30))

    def ask(self, kind: MessageType, payload: dict) -> Message:
        seq = self.send(kind, payload)
        reply = self.receive()
        assert reply.seq == seq
        return reply

    def observe(self, **changes) -> Message:
        return self.ask(MessageType.OBSERVATION, {**observation(0), **changes})

    def close(self) -> None:
        self.ws.close()


@pytest.fixture
def sock(server):
    connection = VlaEvalSocket(server)
    yield connection
    connection.close()


def observation(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"state": rng.uniform(-1, 1, SUITE.state_dim),  # float64, as vla-eval's benchmarks send it
            "task_description": INSTRUCTION,
            "images": {"corner": rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)}}


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(f"{server.http_url}/metrics").text
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_hello_answers_the_policys_specs_in_vla_evals_format(sock, server, checkpoint):
    reply = sock.ask(MessageType.HELLO, make_hello_payload(benchmark="test"))
    assert reply.type is MessageType.HELLO
    hello = reply.payload
    assert hello["protocol_version"] == 1 and hello["model_server"] == "EvalForgePolicyServer"
    assert hello["observation_params"] == {"send_state": True}
    observation_spec = {key: DimSpec.from_dict(spec) for key, spec in hello["observation_spec"].items()}
    action_spec = {key: DimSpec.from_dict(spec) for key, spec in hello["action_spec"].items()}
    assert observation_spec["state"].dims == SUITE.state_dim
    assert observation_spec["language"].format == "language"
    assert observation_spec["corner"].format == "rgb_hwc_uint8" and str(SIDE) in observation_spec["corner"].description
    assert action_spec["actions"].dims == SUITE.action_dim and action_spec["actions"].range == (-1.0, 1.0)
    card = json.loads((checkpoint / "policy.json").read_text())
    ours = hello["evalforge"]
    assert ours["chunk_size"] == CHUNK and ours["state_dim"] == SUITE.state_dim
    assert ours["action_dim"] == SUITE.action_dim and ours["tasks"] == {TASK: INSTRUCTION}
    assert ours["cameras"] == {"corner": [SIDE, SIDE]} and ours["policy_name"] == card["name"]
    native = RawConnection(server.ws_url)
    native.close()
    assert ours["checkpoint_sha256"] == native.metadata.checkpoint_sha256


def test_one_action_row_per_observation_from_a_per_episode_buffer(sock):
    sock.send(MessageType.EPISODE_START, {"task": {"name": TASK}})
    replies = [sock.observe() for _ in range(CHUNK + 1)]
    assert all(r.type is MessageType.ACTION for r in replies)
    rows = [r.payload["actions"] for r in replies]
    assert all(row.dtype == np.float32 and row.shape == (SUITE.action_dim,) for row in rows)
    assert [r.payload["server_timing"].get("cached", 0.0) for r in replies] == [0.0, 1.0, 1.0, 1.0, 0.0]
    sock.send(MessageType.EPISODE_END, {"metrics": {"success": False}})
    sock.send(MessageType.EPISODE_START, {"task": {"name": TASK}})
    again = sock.observe()
    assert again.payload["server_timing"].get("cached", 0.0) == 0.0  # a new episode starts a new chunk
    np.testing.assert_array_equal(again.payload["actions"], rows[0])  # greedy: the same observation, the same row


@pytest.mark.parametrize("description", [INSTRUCTION.upper(), f"  {INSTRUCTION} ", TASK, TASK.upper()])
def test_task_description_matches_a_task_name_or_instruction_ignoring_case(sock, description):
    assert sock.observe(task_description=description).type is MessageType.ACTION


def test_unknown_task_gets_an_error_frame_naming_the_known_tasks(sock):
    reply = sock.observe(task_description="open the drawer")
    assert reply.type is MessageType.ERROR and reply.payload["code"] == "unknown_task"
    assert "'open the drawer'" in reply.payload["error"] and TASK in reply.payload["message"]
    assert INSTRUCTION in reply.payload["message"] and "Traceback" not in reply.payload["error"]
    assert sock.observe().type is MessageType.ACTION


def _png_of_size(height: int, width: int) -> dict:
    return numpy_codec.encode_ndarray(np.zeros((height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(("images", "pattern"), [
    ({}, r"no image of camera 'corner'.*uint8 \[32, 32, 3\]"),
    ({"corner": np.zeros((16, 16, 3), dtype=np.uint8)}, r"must be uint8 \[32, 32, 3\], got png \[16, 16, 3\]"),
    ({"corner": np.zeros((SIDE, SIDE, 4), dtype=np.uint8)}, r"must be uint8 \[32, 32, 3\], got png \[32, 32, 4\]"),
    ({"corner": {"__image__": True, "format": "png", "data": b"not a png", "shape": [SIDE, SIDE, 3]}},
     "png image of camera 'corner' does not decode"),
    ({"corner": {**_png_of_size(SIDE + 1, SIDE), "shape": [SIDE, SIDE, 3]}}, "is 33x32, its 'shape' says 32x32"),
    ({"corner": {"__image__": True, "format": "gif", "data": b"", "shape": [SIDE, SIDE, 3]}}, "format 'gif'"),
    ({"corner": np.zeros((SIDE, SIDE, 3), dtype=np.float32)}, "must be uint8"),
    ({"corner": "a picture"}, "got a str"),
])
def test_a_bad_image_gets_an_error_frame_and_the_server_keeps_serving(sock, images, pattern):
    reply = sock.observe(images=images)
    assert reply.type is MessageType.ERROR and reply.payload["code"] == "invalid_image"
    assert re.search(pattern, reply.payload["message"]), reply.payload["message"]
    assert sock.observe().type is MessageType.ACTION


def test_raw_and_jpeg_images_are_read_too(sock):
    try:
        for fmt in ("raw", "jpeg"):
            numpy_codec.set_image_format(fmt)
            assert sock.observe().type is MessageType.ACTION, fmt
    finally:
        numpy_codec.set_image_format("png")


@pytest.mark.parametrize(("changes", "code", "pattern"), [
    ({"state": np.zeros(SUITE.state_dim - 1)}, "invalid_observation", r"'state' must have shape \[39\]"),
    ({"state": np.full(SUITE.state_dim, np.nan)}, "invalid_observation", "NaN"),
    ({"state": ["a"] * SUITE.state_dim}, "invalid_observation", "1-D array of numbers"),
    ({"state": None}, "invalid_observation", "has no 'state'.*send_state"),
    ({"task_description": 3}, "invalid_observation", "'task_description' must be a string"),
])
def test_a_bad_observation_gets_an_error_frame_naming_the_field(sock, changes, code, pattern):
    reply = sock.observe(**changes)
    assert reply.type is MessageType.ERROR and reply.payload["code"] == code
    assert re.search(pattern, reply.payload["message"]), reply.payload["message"]
    assert sock.observe().type is MessageType.ACTION


def test_frames_outside_the_protocol_get_error_frames_and_the_connection_stays_usable(sock):
    for frame, code in [(b"\xc1", "bad_frame"), ("a text frame", "bad_frame"), (packb([1, 2]), "bad_frame"),
                        (packb({"type": "observation", "payload": {}}), "bad_frame"),
                        (packb({"type": "action", "payload": {}, "seq": 7, "timestamp": 0.0}), "unknown_type")]:
        sock.ws.send(frame)
        reply = sock.receive()
        assert reply.type is MessageType.ERROR and reply.payload["code"] == code, (frame, reply.payload)
    assert sock.observe().type is MessageType.ACTION


def native_returns(server) -> list[float]:
    """Each episode's return with the same policy over ``/ws``, chunks executed whole: what vla-eval must get."""
    raw, returns = RawConnection(server.ws_url), []
    env = SUITE.make_env(TASK, seed=0)
    try:
        for seed in range(EPISODES):
            obs, total, rows = env.reset(seed=seed), 0.0, []
            for _ in range(MAX_STEPS):
                if not rows:
                    images = env.render_images({"corner": (SIDE, SIDE)})
                    request = {"type": "infer", "request_id": 1, "obs": {"state": obs["state"], "task": TASK,
                                                                          "images": images}}
                    rows = list(raw.ask(packb(request))["actions"])
                result = env.step(rows.pop(0))
                obs, total = result.obs, total + result.reward
                if result.done:
                    break
            returns.append(total)
    finally:
        env.close()
        raw.close()
    return returns


def test_vla_eval_run_evaluates_the_checkpoint_on_its_own_runner(server, tmp_path):
    observations = metric(server, "evalforge_policy_requests_total", '{type="vla_eval"}')
    buffered = metric(server, "evalforge_policy_cached_actions_total")
    command = [str(Path(sys.executable).parent / "vla-eval"), "run", "--no-docker", "-c", str(CONFIG),
               "--server-url", f"ws://127.0.0.1:{server.port}/vla-eval", "--output-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Auto-configured from model server: send_state=True" in run.stderr  # the hello's observation_params

    aggregate = json.loads((tmp_path / "metaworld_reach_aggregate.json").read_text())
    (task,) = aggregate["tasks"]
    episodes = task["episodes"]
    assert task["task"] == TASK and len(episodes) == EPISODES
    assert all("failure_reason" not in e for e in episodes), [e.get("failure_detail") for e in episodes]
    assert all(e["metrics"]["action_dim"] == SUITE.action_dim for e in episodes)  # the benchmark got [4] rows
    assert all(isinstance(e["metrics"]["success"], bool) for e in episodes)
    assert aggregate["server_info"]["evalforge"]["chunk_size"] == CHUNK
    # vla-eval drove the same policy: each episode's return is what the native protocol gives
    assert [e["metrics"]["return"] for e in sorted(episodes, key=lambda e: e["episode_id"])] == pytest.approx(
        native_returns(server), rel=1e-6)

    steps = [e["steps"] for e in episodes]
    served = metric(server, "evalforge_policy_requests_total", '{type="vla_eval"}') - observations
    from_buffer = metric(server, "evalforge_policy_cached_actions_total") - buffered
    assert served == sum(steps)
    assert from_buffer == sum(n - math.ceil(n / CHUNK) for n in steps)
    log = server.log_path.read_text()
    for n in steps:
        assert f"served {n} observations ({n - math.ceil(n / CHUNK)} from the chunk buffer); episode ended" in log
