"""Client of a vla-eval model server (allenai's vla-eval harness: ``PredictModelServer`` and kin).

vla-eval's protocol (``vla_eval.protocol.messages``, version ``VLA_EVAL_PROTOCOL_VERSION``),
as its harness's ``Connection`` speaks it: every frame is a msgpack map
``{type, payload, seq, timestamp}``; the client speaks first, ``hello``, and the server
answers ``hello`` with ``model_server`` (its class), ``capabilities`` and, when declared,
``action_spec``, ``observation_spec`` (``{component: {name, dims, format, ...}}``) and
``observation_params``. An episode is ``episode_start`` (``{"task": {...}}``), then one
``observation`` per step, each answered by an ``action`` (``{"actions": [A] or [chunk, A]}``)
or an ``error`` (``{"error": "..."}``) carrying the observation's ``seq``, then
``episode_end``. A server with a ``chunk_size`` answers one action row per observation
from its own buffer. Arrays travel as maps with *text* keys (``__ndarray__``, ``data``,
``dtype``, ``shape``); ``uint8 [H, W, C]`` images as ``{__image__, format, data, shape}``.

What this client sends and makes of it:

- observations ``{images: {camera: image}, state, task_description}`` under the
  registration's ``observation_keys`` (defaults: ``adapters.DEFAULT_OBSERVATION_KEYS
  ["vla-eval"]``); the state float32;
- images PNG-encoded, as vla-eval's harness sends them by default (its ``numpy_codec``
  image format is ``png`` unless a caller changes it): lossless, so the server decodes
  exactly the pixels rendered. The encoder is ``png_bytes`` (zlib level 1: PNG's
  compression level changes only the size and the time, never the pixels);
- ``episode_start`` on the first ``infer`` of each episode (a new ``episode_id``, or the
  first after ``reset``), with ``{"task": {"name": <task>}}``; ``episode_end`` on
  ``reset`` and ``close``. After a reconnect the new connection gets ``hello`` and
  ``episode_start`` again before the observation is resent (the server's session, and its
  action buffer, are new);
- ``ServerInfo``: ``policy_name`` = ``model_server``; ``action_dim`` = the sum of the action
  spec's ``dims`` when every component has some; ``state_dim`` = the observation spec's
  ``state`` ``dims`` when given; no checkpoint, tasks or camera sizes (the hello has none);
  the hello payload in ``raw``;
- replies are matched to their observation by ``seq`` (a late one to a timed-out call is
  dropped), held to ``checked_actions``; an ``error`` becomes ``PolicyError("server_error")``
  with its first line.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

from services.protocol.adapters import (
    ServerInfo,
    check_observation_keys,
    json_summary,
    remap_observation,
)
from services.protocol.client import (
    ClientSettings,
    WebSocketAdapter,
    _as_observation,
    _check_checkpoint,
    checked_actions,
    server_error,
)
from services.protocol.codec import ProtocolError, unpackb
from services.protocol.messages import (
    CAMERA_NAME_PATTERN,
    MAX_CAMERAS,
    MAX_IMAGE_SIDE,
    MAX_POLICY_NAME_CHARS,
    MAX_TASK_NAME_CHARS,
    MAX_TASKS,
    SHA256_PATTERN,
    ActionsReply,
    Observation,
)

__all__ = ["VLA_EVAL_PROTOCOL_VERSION", "VlaEvalClient", "pack_frame", "png_bytes", "server_info_from_hello"]

VLA_EVAL_PROTOCOL_VERSION = 1
CLIENT_NAME = "evalforge"
MAX_DIM = 1 << 16


def png_bytes(image: np.ndarray) -> bytes:
    """``image`` (uint8 ``[H, W, 1|3|4]``, C-contiguous) as a PNG file: 8-bit gray, RGB or RGBA,
    no filter, zlib level 1. Lossless: any PNG decoder gives back the same array."""
    height, width, channels = image.shape
    color_type = {1: 0, 3: 2, 4: 6}[channels]
    rows = np.empty((height, 1 + width * channels), dtype=np.uint8)
    rows[:, 0] = 0  # filter type None on every scanline
    rows[:, 1:] = image.reshape(height, width * channels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
            + chunk(b"IEND", b""))


def _encode(value: Any) -> Any:
    """msgpack's ``default`` for vla-eval frames: arrays as text-keyed maps, images as PNG."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"cannot send an array of dtype {value.dtype} to a vla-eval server (bool, int, uint "
                            "and float only)")
        if value.ndim == 3 and value.dtype == np.uint8 and value.shape[2] in (1, 3, 4):
            return {"__image__": True, "format": "png", "data": png_bytes(np.ascontiguousarray(value)),
                    "shape": list(value.shape)}
        return {"__ndarray__": True, "data": value.tobytes(), "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} in a vla-eval frame")


def pack_frame(kind: str, payload: dict[str, Any], seq: int) -> bytes:
    """One vla-eval message frame: ``{type, payload, seq, timestamp}``, arrays and images as ``_encode`` sends them."""
    return msgpack.packb({"type": kind, "payload": payload, "seq": seq, "timestamp": time.time()},
                         default=_encode, use_bin_type=True)


def _dims(spec: Any) -> int | None:
    """A spec component's ``dims`` when it is a positive integer."""
    dims = spec.get("dims") if isinstance(spec, dict) else None
    return dims if type(dims) is int and 0 < dims <= MAX_DIM else None


def server_info_from_hello(payload: Mapping[str, Any]) -> ServerInfo:
    """What a vla-eval hello reply says in our terms (see the module docstring)."""
    action_spec = payload.get("action_spec")
    action_dims = [_dims(spec) for spec in action_spec.values()] if isinstance(action_spec, dict) else []
    declared = [dims for dims in action_dims if dims is not None]
    observation_spec = payload.get("observation_spec")
    name = payload.get("model_server")
    ours = _evalforge_block(payload.get("evalforge"))
    return ServerInfo(
        protocol="vla-eval",
        policy_name=ours.get("policy_name") or (
            name[:200] if isinstance(name, str) and name and name.isprintable() else None),
        checkpoint_sha256=ours.get("checkpoint_sha256"),
        revision=None,
        state_dim=_dims(observation_spec.get("state")) if isinstance(observation_spec, dict) else None,
        action_dim=sum(declared) if declared and len(declared) == len(action_dims) else None,
        chunk_size=ours.get("chunk_size"),
        tasks=ours.get("tasks", ()),
        cameras=ours.get("cameras", {}),
        raw=json_summary(payload),
    )


def _evalforge_block(block: Any) -> dict[str, Any]:
    """What an EvalForge policy server's ``/vla-eval`` hello adds (its ``evalforge`` block): the checkpoint's
    sha256, chunk size, tasks and camera sizes, taken where they are well-formed and ignored otherwise (a
    hello is a peer's word; only what fits the handshake's own caps is kept)."""
    if not isinstance(block, dict):
        return {}
    ours: dict[str, Any] = {}
    name = block.get("policy_name")
    if isinstance(name, str) and 0 < len(name) <= MAX_POLICY_NAME_CHARS and name.isprintable():
        ours["policy_name"] = name
    sha256 = block.get("checkpoint_sha256")
    if isinstance(sha256, str) and SHA256_PATTERN.fullmatch(sha256):
        ours["checkpoint_sha256"] = sha256
    chunk = block.get("chunk_size")
    if type(chunk) is int and 1 <= chunk <= 1_000_000:
        ours["chunk_size"] = chunk
    tasks = block.get("tasks")
    names = list(tasks) if isinstance(tasks, dict | list) else []
    if 0 < len(names) <= MAX_TASKS and all(isinstance(t, str) and 0 < len(t) <= MAX_TASK_NAME_CHARS
                                           and t.isprintable() for t in names):
        ours["tasks"] = tuple(names)
    cameras = block.get("cameras")
    if isinstance(cameras, dict) and len(cameras) <= MAX_CAMERAS and all(
            isinstance(c, str) and CAMERA_NAME_PATTERN.fullmatch(c) and isinstance(size, list | tuple)
            and len(size) == 2 and all(type(v) is int and 1 <= v <= MAX_IMAGE_SIDE for v in size)
            for c, size in cameras.items()):
        ours["cameras"] = {c: (size[0], size[1]) for c, size in cameras.items()}
    return ours


class VlaEvalClient(WebSocketAdapter):
    """Blocking client of a vla-eval model server; see the module docstring.

    ``observation_keys``: canonical field → the server's key (``check_observation_keys``; None
    takes vla-eval's defaults). ``expected_checkpoint``: vla-eval's hello names no checkpoint,
    so nothing can be checked (it is kept for the day a server says). ``action_dim``: the width
    every reply must have (else the one the action spec adds up to, if any).
    """

    protocol = "vla-eval"
    server_kind = "a vla-eval model server"
    start_hint = "check that the model server (`vla-eval serve`, or its script) is running there and reachable"

    def __init__(self, url: str, settings: ClientSettings | None = None, *,
                 observation_keys: Mapping[str, str] | None = None, expected_checkpoint: str | None = None,
                 action_dim: int | None = None) -> None:
        super().__init__(url, settings)
        self.observation_keys = check_observation_keys("vla-eval", observation_keys)
        self.expected_checkpoint = expected_checkpoint
        self.action_dim = action_dim
        self._seq = 0
        self._episode: str | None = None  # the episode the next observation belongs to
        self._started_on: ClientConnection | None = None  # the connection its episode_start went over
        self._start_seq: int | None = None

    def __enter__(self) -> VlaEvalClient:
        self.connect()
        return self

    def _send(self, ws: ClientConnection, kind: str, payload: dict[str, Any]) -> int:
        self._seq += 1
        ws.send(pack_frame(kind, payload, self._seq))
        return self._seq

    def _message(self, frame: str | bytes) -> dict[str, Any]:
        if isinstance(frame, str):
            raise ProtocolError("the vla-eval server sent a text frame; its protocol uses binary msgpack frames")
        message = unpackb(frame, self.settings.limits)
        if (not isinstance(message, dict) or not isinstance(message.get("type"), str)
                or not isinstance(message.get("payload"), dict) or type(message.get("seq")) is not int):
            raise ProtocolError("the vla-eval server sent a frame that is not a {type, payload, seq, timestamp} "
                                "message")
        return message

    def _greet(self, ws: ClientConnection, deadline: float) -> ServerInfo:
        self._started_on = None
        seq = self._send(ws, "hello", {"harness_version": CLIENT_NAME, "protocol_version": VLA_EVAL_PROTOCOL_VERSION,
                                       "client": CLIENT_NAME})
        while True:
            message = self._message(ws.recv(timeout=max(deadline - time.monotonic(), 0.0)))
            if message["seq"] == seq:
                break
        if message["type"] == "error":
            raise server_error(message["payload"].get("error", ""))
        if message["type"] != "hello":
            raise ProtocolError(f"the vla-eval server answered hello with a {message['type'][:40]!r} message")
        version = message["payload"].get("protocol_version", VLA_EVAL_PROTOCOL_VERSION)
        if version != VLA_EVAL_PROTOCOL_VERSION:
            raise ProtocolError(f"the vla-eval server speaks protocol version {str(version)[:20]}, this client "
                                f"speaks {VLA_EVAL_PROTOCOL_VERSION}; use a model server of vla-eval 0.x")
        info = server_info_from_hello(message["payload"])
        _check_checkpoint(self.url, self.expected_checkpoint, info.checkpoint_sha256, info.revision)
        return info

    def _exchange(self, ws: ClientConnection, obs: Observation, request: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.settings.call_timeout_s
        if self._started_on is not ws:
            self._start_seq = self._send(ws, "episode_start", {"task": {"name": obs.task}})
            self._started_on = ws
        seq = self._send(ws, "observation", request)
        while True:
            message = self._message(self._recv(ws, deadline))
            if message["type"] == "error" and message["seq"] in (seq, self._start_seq):
                raise server_error(message["payload"].get("error", ""))
            if message["seq"] != seq:
                continue  # a late answer to an observation whose call timed out
            if message["type"] != "action":
                raise ProtocolError(f"the vla-eval server answered an observation with a "
                                    f"{message['type'][:40]!r} message; expected action or error")
            if "actions" not in message["payload"]:
                raise ProtocolError("the vla-eval server's action message has no 'actions'")
            return message["payload"]["actions"]

    def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None,
              step: int = 0) -> ActionsReply:
        """The action chunk for ``obs``; a new ``episode_id`` ends the previous episode and starts one."""
        obs = _as_observation(obs)
        if episode_id != self._episode:
            self._end_episode()
            self._episode = episode_id
        request = remap_observation(obs, self.observation_keys)
        actions = self._call(lambda ws: self._exchange(ws, obs, request))
        action_dim = self.action_dim if self.action_dim is not None else self.info.action_dim
        return ActionsReply(request_id=self._seq, actions=checked_actions(actions, action_dim))

    def _end_episode(self) -> None:
        """``episode_end`` for the episode open on the live connection, if any (no reply comes)."""
        ws, self._started_on = self._started_on, None
        if ws is not None and ws is self._ws:
            try:
                self._send(ws, "episode_end", {})
            except (ConnectionClosed, OSError):
                self.close()  # the next call reconnects

    def reset(self, episode_id: str | None = None) -> None:
        """End the current episode on the server; the next ``infer`` starts ``episode_id``."""
        self._end_episode()
        self._episode = episode_id

    def close(self) -> None:
        self._end_episode()
        super().close()
