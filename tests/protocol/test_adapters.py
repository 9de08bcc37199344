"""The one client interface: observation keys, reply checks, greetings, and what every protocol's
client does against a server that never greets it or is gone.

``ServerThread`` and ``SilentServer`` are used by the openpi and vla-eval adapter tests too."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from websockets.sync.server import ServerConnection
from websockets.sync.server import serve as sync_serve

from services.protocol.adapters import (
    DEFAULT_OBSERVATION_KEYS,
    MAX_RAW_BYTES,
    PROTOCOLS,
    PolicyAdapter,
    ServerInfo,
    check_observation_keys,
    json_summary,
    make_client,
    remap_observation,
)
from services.protocol.client import (
    NOT_A_POLICY_SERVER,
    REFUSED,
    ClientSettings,
    PolicyClient,
    PolicyError,
    PolicyUnavailable,
    checked_actions,
    server_error,
)
from services.protocol.codec import ProtocolError
from services.protocol.messages import Observation
from services.protocol.openpi import OpenPiClient, server_info_from_openpi
from services.protocol.vla_eval import VlaEvalClient, png_bytes, server_info_from_hello
from services.supervisor import free_port
from tests.protocol.loopback_server import CHUNK, STATE_DIM, LoopbackPolicyServer

QUICK = ClientSettings(connect_deadline_s=1.0, call_timeout_s=2.0, initial_backoff_s=0.01, max_backoff_s=0.1)


class ServerThread:
    """An asyncio server coroutine (openpi's ``WebsocketPolicyServer.run()``, vla-eval's
    ``serve_async``) on its own event loop in a thread, until ``stop``."""

    def __init__(self, serve: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self._serve = serve
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[Any] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self._task = self._loop.create_task(self._serve())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        while self._task is None and self._thread.is_alive():
            time.sleep(0.01)
        if self._task is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the test server did not stop"


class SilentServer:
    """A WebSocket server that accepts every connection and never sends a frame (nor answers one)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.connections = 0
        self._server = sync_serve(self._handle, "127.0.0.1", self.port)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        for _ in ws:  # read and ignore (a vla-eval hello) until the client hangs up
            pass

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(10)


def canonical(state_dim: int = 4, cameras: tuple[str, ...] = ()) -> Observation:
    rng = np.random.default_rng(7)
    return Observation(state=rng.standard_normal(state_dim).astype(np.float32), task="reach-v3",
                       images={c: rng.integers(0, 256, (8, 6, 3), dtype=np.uint8) for c in cameras})


# --- observation keys -------------------------------------------------------------------------------

def test_each_protocol_has_its_documented_defaults():
    assert set(DEFAULT_OBSERVATION_KEYS) == set(PROTOCOLS) == {"evalforge", "openpi", "vla-eval"}
    assert check_observation_keys("openpi", None) == {"state": "observation/state", "task": "prompt",
                                                      "images.*": "observation/<camera>"}
    assert check_observation_keys("vla-eval", {}) == {"state": "state", "task": "task_description",
                                                      "images.*": "images.<camera>"}
    assert check_observation_keys("evalforge", None) == {"state": "state", "task": "task",
                                                         "images.*": "images.<camera>"}


def test_registration_keys_go_over_the_defaults():
    keys = check_observation_keys("openpi", {"images.agentview": "observation/image",
                                             "images.wrist": "observation/wrist_image"})
    assert keys == {"state": "observation/state", "task": "prompt", "images.*": "observation/<camera>",
                    "images.agentview": "observation/image", "images.wrist": "observation/wrist_image"}


@pytest.mark.parametrize(("keys", "message"), [
    ({"proprio": "x"}, "'proprio', which is not a canonical observation field; the fields are 'state', 'task'"),
    ({"images.": "x"}, "not a canonical observation field"),
    ({"images.bad camera": "x"}, "not a canonical observation field"),
    ({"state": "prompt"}, "sends 'state' and 'task' to the same key ('prompt', 'prompt')"),
    ({"images.front": "observation/state"}, "to the same key"),
    ({"state": "obs", "task": "obs.task"}, "keys inside one another"),
    ({"images.*": "observation/image"}, "must hold '<camera>' once"),
    ({"state": "state/<camera>"}, "only the 'images.*' rule may use"),
    ({"state": ""}, "printable string of 1 to 200"),
    ({"state": 3}, "printable string of 1 to 200"),
    ({"state": "a..b"}, "empty part between dots"),
])
def test_bad_observation_keys_are_refused_naming_the_problem(keys, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_observation_keys("openpi", keys)


def test_evalforge_keys_cannot_be_remapped_and_unknown_protocols_are_named():
    with pytest.raises(ValueError, match="leave observation_keys out"):
        check_observation_keys("evalforge", {"state": "obs"})
    with pytest.raises(ValueError, match="the protocols are evalforge, openpi, vla-eval"):
        check_observation_keys("grpc", None)
    with pytest.raises(ValueError, match="the protocols are"):
        make_client("grpc", "ws://127.0.0.1:1")


def test_remapping_puts_each_field_under_its_key_flat_or_nested():
    obs = canonical(cameras=("agentview", "wrist", "side.left"))
    libero = remap_observation(obs, check_observation_keys("openpi", {"images.agentview": "observation/image",
                                                                      "images.wrist": "observation/wrist_image"}))
    assert set(libero) == {"observation/state", "prompt", "observation/image", "observation/wrist_image",
                           "observation/side.left"}  # the rule keeps a dotted camera name one key
    np.testing.assert_array_equal(libero["observation/image"], obs.images["agentview"])
    assert libero["prompt"] == "reach-v3" and libero["observation/state"].dtype == np.float32

    nested = remap_observation(obs, check_observation_keys("vla-eval", {"state": "states"}))
    assert set(nested) == {"states", "task_description", "images"}
    assert set(nested["images"]) == {"agentview", "wrist", "side.left"}

    aloha = remap_observation(obs, check_observation_keys("openpi", {"images.*": "images.cam_<camera>"}))
    assert set(aloha["images"]) == {"cam_agentview", "cam_wrist", "cam_side.left"}


def test_a_camera_the_rule_puts_on_another_fields_key_is_refused():
    keys = check_observation_keys("openpi", {"task": "observation/front"})
    with pytest.raises(ProtocolError, match="'task' and 'images.front' land on the same server key"):
        remap_observation(canonical(cameras=("front",)), keys)


# --- replies and greetings ------------------------------------------------------------------------

def test_actions_are_float32_chunks_and_bad_ones_are_invalid_actions():
    assert checked_actions(np.arange(4, dtype=np.float64), 4).shape == (1, 4)
    chunk = checked_actions([[1, 2], [3, 4], [5, 6]], None)
    assert chunk.dtype == np.float32 and chunk.shape == (3, 2) and chunk.flags.c_contiguous
    for bad, message in [(np.zeros((2, 5)), r"shape \[2, 5\]; expected \[chunk, 4\]"),
                         (np.full(4, np.nan), "NaN or infinity"),
                         (np.array([1e39, 0, 0, 0]), "NaN or infinity"),  # finite as float64, not as float32
                         (np.zeros((1, 2, 4)), r"shape \[1, 2, 4\]"),
                         (np.zeros((0, 4)), r"shape \[0, 4\]"),
                         (np.array(["a", "b", "c", "d"]), "dtype <U1"),
                         ([[1, 2], [3]], "ragged"),
                         ({"x": 1}, "are a dict")]:
        with pytest.raises(PolicyError, match=message) as caught:
            checked_actions(bad, 4)
        assert caught.value.code == "invalid_actions"


def test_a_server_failure_is_one_line_never_a_traceback():
    try:
        raise ValueError("the gripper camera is missing\nsecond line")
    except ValueError:
        import traceback

        text = traceback.format_exc()
    failure = server_error(text)
    assert failure.code == "server_error" and failure.message == "second line"
    assert server_error("observation_failed: KeyError: 'x'\nmore").message == "observation_failed: KeyError: 'x'"
    assert len(server_error("x" * 1000).message) == 200
    assert server_error("").message == "the server failed and said nothing"


def test_greetings_become_server_info_with_json_safe_raw():
    info = server_info_from_openpi({"policy_name": "pi05_libero", "action_dim": 7, "chunk_size": "ten",
                                    "checkpoint_sha256": "not-a-sha", "norm": np.zeros((2, 3)), "x": float("nan")})
    assert (info.protocol, info.policy_name, info.action_dim, info.chunk_size, info.checkpoint_sha256) == (
        "openpi", "pi05_libero", 7, None, None)
    assert info.tasks == () and info.cameras == {}
    assert info.raw["norm"] == {"array": {"shape": [2, 3], "dtype": "<f8"}} and info.raw["x"] == "nan"

    hello = server_info_from_hello({"model_server": "Pi0ModelServer", "action_spec": {
        "position": {"name": "position", "dims": 3, "format": "delta_xyz"},
        "gripper": {"name": "gripper", "dims": 1, "format": "binary_close_positive"}},
        "observation_spec": {"state": {"name": "state", "dims": 8, "format": "raw"}}})
    assert (hello.protocol, hello.policy_name, hello.action_dim, hello.state_dim) == (
        "vla-eval", "Pi0ModelServer", 4, 8)
    raw_only = server_info_from_hello({"model_server": "X", "action_spec": {"actions": {"dims": 0}}})
    assert raw_only.action_dim is None and raw_only.state_dim is None

    huge = json_summary({"blob": "x" * (MAX_RAW_BYTES + 1), "small": 1})
    assert huge["truncated"] is True and huge["keys"] == ["blob", "small"]


def test_png_images_decode_to_the_same_pixels():
    zlib_png = pytest.importorskip("PIL.Image")
    import io

    image = np.random.default_rng(3).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(zlib_png.open(io.BytesIO(png_bytes(image)))), image)


# --- ours, through the interface -----------------------------------------------------------------

def test_make_client_gives_each_protocol_its_client():
    for protocol, kind in [("evalforge", PolicyClient), ("openpi", OpenPiClient), ("vla-eval", VlaEvalClient)]:
        client = make_client(protocol, "ws://127.0.0.1:1")
        assert isinstance(client, kind) and isinstance(client, PolicyAdapter) and client.protocol == protocol


def test_our_server_through_the_interface():
    server = LoopbackPolicyServer().start()
    try:
        with make_client("evalforge", server.url, QUICK) as client:
            info = client.info
            assert isinstance(info, ServerInfo) and info == client.connect()
            assert (info.protocol, info.policy_name, info.state_dim, info.chunk_size) == (
                "evalforge", "loopback", STATE_DIM, CHUNK)
            assert info.tasks == ("reach-v3", "push-v3") and info.raw["policy_name"] == "loopback"
            assert client.infer(canonical(STATE_DIM)).actions.shape == (CHUNK, info.action_dim)
    finally:
        server.stop()


# --- servers that never greet, and servers that are gone ---------------------------------------------

@pytest.mark.parametrize(("protocol", "kind"), [("evalforge", "a policy server"),
                                                ("openpi", "an openpi policy server"),
                                                ("vla-eval", "a vla-eval model server")])
def test_a_server_that_never_greets_is_unavailable_within_the_deadline(protocol, kind):
    with SilentServer() as silent:
        start = time.monotonic()
        with pytest.raises(PolicyUnavailable, match=f"nothing answered as {kind} within 1 s") as caught:
            make_client(protocol, silent.url, QUICK).connect()
        assert time.monotonic() - start < QUICK.connect_deadline_s + 1.5
        assert caught.value.reason == NOT_A_POLICY_SERVER and silent.connections >= 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_server_that_is_gone_is_unavailable(protocol):
    url = f"ws://127.0.0.1:{free_port()}"
    with pytest.raises(PolicyUnavailable, match=REFUSED) as caught:
        make_client(protocol, url, QUICK).infer(canonical())
    assert caught.value.reason == REFUSED
