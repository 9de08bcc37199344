"""vla-eval's model-server protocol on the policy server (WebSocket ``/vla-eval``).

With it, allenai's vla-eval harness evaluates an EvalForge checkpoint with its own
benchmarks and runners, as it would any of its model servers::

    vla-eval run --no-docker -c CONFIG.yaml --server-url ws://HOST:PORT/vla-eval

This endpoint answers exactly what ``vla_eval.model_servers.serve`` answers for a
``PredictModelServer`` (vla-eval 0.8.0, protocol version 1):

- Every frame, both ways, is MessagePack ``{type, payload, seq, timestamp}``; NumPy
  arrays travel as maps with the *text* keys ``__ndarray__``, ``data``, ``dtype``,
  ``shape`` (vla-eval decodes no other form, so replies are packed here rather than
  with ``services.protocol.codec.packb``, whose keys are binary as openpi's are).
  Incoming frames are decoded by ``services.protocol.codec.unpackb``, with all its
  caps and checks.
- ``hello`` → ``hello`` with ``harness_version``, ``protocol_version``,
  ``model_server``, ``capabilities``, ``observation_params`` (``send_state: true``:
  the policy reads the state), and the policy's specs in vla-eval's ``DimSpec``
  form: ``observation_spec`` = ``state`` (``dims`` = state dim), ``language``, and
  one ``rgb_hwc_uint8`` entry per camera the checkpoint's card declares;
  ``action_spec`` = ``actions`` (``dims`` = action dim, ``raw``: the convention is the
  training data's). An ``evalforge`` entry adds what vla-eval has no field for:
  policy name, checkpoint sha256, state/action dims, chunk size, tasks with their
  instructions, cameras as ``[H, W]``.
- ``episode_start`` and ``episode_end`` get no reply; each drops the episode's
  buffered actions.
- ``observation`` ``{images: {camera: image}, state, task_description}`` →
  ``action`` ``{actions: float32[action_dim], server_timing}`` with the observation's
  ``seq``. One action row per observation, as ``PredictModelServer(chunk_size=N)``
  does: the first observation of a chunk runs the policy (the same path as ``/ws``'s
  stepwise requests: ``PolicyService.infer``), the next ``chunk - 1`` are answered
  from the episode's buffer. Rows, not chunks, because vla-eval's runners apply each
  reply as one environment step (``SyncEpisodeRunner`` calls
  ``benchmark.apply_action`` once per ``act``) and its benchmarks read ``actions``
  as one action vector. Every observation is still checked, buffered or not.

Observations map to the canonical ``Observation``: ``state`` (any real-valued 1-D
array or list; cast to float32) must have the policy's state dim; ``task_description``
must equal one of the policy's task names or instructions, ignoring case and
surrounding spaces; images come as vla-eval sends them (an ``__image__`` map, PNG by
default, JPEG or raw) or as arrays, and for a camera policy are held to the card
(``Observation.check_images``); a state-only policy ignores them undecoded.

Anything wrong gets an ``error`` frame ``{error: "<code>: <message>", code,
message}`` with the offending frame's ``seq`` (vla-eval's client raises on it and
fails that episode) — never a traceback — and the connection keeps serving.
"""

from __future__ import annotations

import io
import logging
import time
import uuid
from typing import Any

import msgpack
import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.policy_server.app import PolicyService, RequestError
from services.protocol.codec import ProtocolError, unpackb
from services.protocol.messages import (
    MAX_IMAGE_SIDE,
    ErrorCode,
    InferRequest,
    InvalidImage,
    InvalidObservation,
    Observation,
    ResetRequest,
)

log = logging.getLogger(__name__)

VLA_EVAL_PROTOCOL_VERSION = 1
"""``vla_eval.protocol.messages.PROTOCOL_VERSION`` of the release below."""
VLA_EVAL_RELEASE = "0.8.0"
"""The vla-eval release whose protocol this endpoint follows (sent as ``harness_version``)."""
MODEL_SERVER_NAME = "EvalForgePolicyServer"
CLIENT_TYPES = ("hello", "episode_start", "observation", "episode_end")
IMAGE_FORMATS = ("png", "jpeg", "raw")
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
_MAX_LISTED_TASKS = 10


class FrameRefused(Exception):
    """A frame this endpoint answers with an ``error`` frame."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _encode_default(obj: Any) -> Any:
    """msgpack ``default``: arrays as vla-eval's numpy codec writes them (text keys)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"cannot send an array of dtype {obj.dtype} to vla-eval (bool, int, uint, float only)")
        return {"__ndarray__": True, "data": obj.tobytes(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in a vla-eval frame")


def pack_frame(kind: str, payload: dict[str, Any], seq: int) -> bytes:
    """One vla-eval frame: ``{type, payload, seq, timestamp}``."""
    frame = {"type": kind, "payload": payload, "seq": seq, "timestamp": time.time()}
    return msgpack.packb(frame, default=_encode_default, use_bin_type=True)


def _dim_spec(name: str, dims: int, fmt: str, description: str = "",
              value_range: tuple[float, float] | None = None) -> dict[str, Any]:
    """A ``vla_eval.specs.DimSpec.to_dict()``."""
    spec: dict[str, Any] = {"name": name, "dims": dims, "format": fmt}
    if value_range is not None:
        spec["range"] = [value_range[0], value_range[1]]
    if description:
        spec["description"] = description
    return spec


def hello_payload(service: PolicyService) -> dict[str, Any]:
    """What ``hello`` is answered with: vla-eval's fields, then the policy's identity under ``evalforge``."""
    meta, card = service.metadata, service.checkpoint.card
    observation_spec = {"state": _dim_spec("state", meta.state_dim, "raw", "float32 state vector"),
                        "language": _dim_spec("language", 0, "language", "the task's instruction or name")}
    for camera, (height, width) in meta.cameras.items():
        observation_spec[camera] = _dim_spec("image", 0, "rgb_hwc_uint8", f"uint8 [{height}, {width}, 3]")
    action_range = (float(min(card.action_low)), float(max(card.action_high)))
    action_spec = {"actions": _dim_spec("actions", meta.action_dim, "raw",
                                        f"one float32 [{meta.action_dim}] row per observation, from chunks of "
                                        f"{meta.chunk_size}", action_range)}
    return {
        "harness_version": VLA_EVAL_RELEASE,
        "protocol_version": VLA_EVAL_PROTOCOL_VERSION,
        "model_server": MODEL_SERVER_NAME,
        "capabilities": {},
        "observation_params": {"send_state": True},
        "action_spec": action_spec,
        "observation_spec": observation_spec,
        "evalforge": {
            "policy_name": meta.policy_name,
            "checkpoint_sha256": meta.checkpoint_sha256,
            "state_dim": meta.state_dim,
            "action_dim": meta.action_dim,
            "chunk_size": meta.chunk_size,
            "tasks": {task: card.instructions.get(task, "") for task in meta.tasks},
            "cameras": {camera: [height, width] for camera, (height, width) in meta.cameras.items()},
        },
    }


def _image(camera: str, value: Any, expected: tuple[int, int]) -> np.ndarray:
    """The uint8 [H, W, C] array in a vla-eval image (an ``__image__`` map or an array), decoded and checked."""
    label = repr(camera[:64])
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, dict) or value.get("__image__") is not True:
        raise InvalidImage(camera, f"image of camera {label} must be uint8 [{expected[0]}, {expected[1]}, 3], as an "
                                   f"array or vla-eval's encoded image, got a {type(value).__name__}")
    fmt, data, shape = value.get("format"), value.get("data"), value.get("shape")
    if fmt not in IMAGE_FORMATS:
        raise InvalidImage(camera, f"image of camera {label} has format {str(fmt)[:20]!r}; vla-eval images are "
                                   f"{', '.join(IMAGE_FORMATS)}")
    if type(data) is not bytes:
        raise InvalidImage(camera, f"image of camera {label} must carry binary 'data', got {type(data).__name__}")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(type(n) is int and 0 < n <= MAX_IMAGE_SIDE for n in shape)):
        raise InvalidImage(camera, f"image of camera {label} must declare 'shape' [H, W, C] with sides 1 to "
                                   f"{MAX_IMAGE_SIDE}, got {str(shape)[:60]}")
    if (shape[0], shape[1]) != expected or shape[2] != 3:
        raise InvalidImage(camera, f"image of camera {label} must be uint8 [{expected[0]}, {expected[1]}, 3], got "
                                   f"{fmt} {shape}; render it at {expected[0]}x{expected[1]} RGB")
    if fmt == "raw":
        if value.get("dtype") != "|u1" or len(data) != shape[0] * shape[1] * shape[2]:
            raise InvalidImage(camera, f"raw image of camera {label} must be uint8 ('|u1') with "
                                       f"{shape[0] * shape[1] * shape[2]} bytes of data, got {str(value.get('dtype'))[:20]} "
                                       f"with {len(data)} bytes")
        return np.frombuffer(data, np.uint8).reshape(shape)
    # Pillow comes with the engine's stack (vLLM requires it); imported here, where an encoded image first needs it.
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[_PIL_FORMATS[fmt]]) as picture:
            if picture.size != (shape[1], shape[0]):  # checked before the pixels are decoded
                raise InvalidImage(camera, f"{fmt} image of camera {label} is {picture.size[1]}x{picture.size[0]}, "
                                           f"its 'shape' says {shape[0]}x{shape[1]}")
            pixels = np.asarray(picture)
    except InvalidImage:
        raise
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise InvalidImage(camera, f"{fmt} image of camera {label} does not decode: {str(exc)[:120]}") from None
    if pixels.shape != tuple(shape) or pixels.dtype != np.uint8:
        raise InvalidImage(camera, f"{fmt} image of camera {label} decodes to {pixels.dtype} {list(pixels.shape)}, "
                                   f"not uint8 {shape}; send RGB")
    return pixels


def _state(payload: dict[str, Any]) -> np.ndarray:
    state = payload.get("state")
    if state is None:
        raise InvalidObservation("observation has no 'state'; this policy reads the state vector (its hello asks for "
                                 "observation_params send_state: true)")
    if isinstance(state, list | tuple):
        try:
            state = np.asarray(state)
        except ValueError:
            raise InvalidObservation("observation field 'state' must be a flat list of numbers") from None
    if not isinstance(state, np.ndarray) or state.dtype.kind not in "iuf" or state.ndim != 1:
        got = f"{state.dtype} of shape {list(state.shape)}" if isinstance(state, np.ndarray) else type(state).__name__
        raise InvalidObservation(f"observation field 'state' must be a 1-D array of numbers, got {got}")
    state = state.astype(np.float32)
    if not np.isfinite(state).all():
        raise InvalidObservation("observation field 'state' contains NaN or infinity (or values beyond float32)")
    return state


class VlaEvalEndpoint:
    """``/vla-eval`` for one ``PolicyService``: ``serve`` runs one client connection."""

    def __init__(self, service: PolicyService) -> None:
        self.service = service
        self.hello = hello_payload(service)
        instructions = service.checkpoint.card.instructions
        self._task_by_text: dict[str, str] = {}
        for task in service.metadata.tasks:  # names win over another task's instruction
            instruction = instructions.get(task, "").strip().casefold()
            if instruction:
                self._task_by_text.setdefault(instruction, task)
        self._task_by_text.update({task.strip().casefold(): task for task in service.metadata.tasks})
        listed = [f"{task!r} ({instructions[task]!r})" if instructions.get(task) else repr(task)
                  for task in service.metadata.tasks[:_MAX_LISTED_TASKS]]
        more = len(service.metadata.tasks) - _MAX_LISTED_TASKS
        self._known_tasks = ", ".join(listed) + (f" and {more} more" if more > 0 else "")

    def task(self, description: Any) -> str:
        """The policy's task that ``task_description`` names (its name or instruction, any case)."""
        if not isinstance(description, str):
            raise InvalidObservation("observation field 'task_description' must be a string (a task's instruction or "
                                     f"name), got {type(description).__name__}")
        task = self._task_by_text.get(description.strip().casefold())
        if task is None:
            raise FrameRefused(ErrorCode.UNKNOWN_TASK,
                               f"task_description {description[:80]!r} names none of this policy's tasks (by name or "
                               f"instruction, ignoring case); known tasks: {self._known_tasks}")
        return task

    def observation(self, payload: Any) -> Observation:
        """The canonical observation in an ``observation`` frame's payload."""
        if not isinstance(payload, dict):
            raise InvalidObservation(f"an observation's payload must be a map, got {type(payload).__name__}")
        state, task = _state(payload), self.task(payload.get("task_description"))
        cameras = self.service.metadata.cameras
        images: dict[str, np.ndarray] = {}
        if cameras:
            sent = payload.get("images")
            if sent is None:
                sent = {}
            if not isinstance(sent, dict):
                raise InvalidObservation("observation field 'images' must map camera names to images, got "
                                         f"{type(sent).__name__}")
            images = {camera: _image(camera, sent[camera], size) for camera, size in cameras.items() if camera in sent}
        observation = Observation(state=state, task=task, images=images)
        observation.check_images(cameras)
        return observation

    async def serve(self, ws: WebSocket) -> None:
        """Answer one connection's frames in order until the client leaves."""
        await ws.accept()
        self.service.metrics.connections.inc()
        session = _Session(self)
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                frame = message.get("bytes")
                if frame is None:
                    reply = self.error_frame(0, ErrorCode.BAD_FRAME, "text frames are not part of vla-eval's protocol; "
                                                                     "send binary msgpack frames")
                else:
                    reply = await session.answer(frame)
                if reply is not None:
                    await ws.send_bytes(reply)
        except WebSocketDisconnect:
            pass
        finally:
            session.close()
            self.service.metrics.connections.dec()

    def error_frame(self, seq: int, code: ErrorCode, message: str) -> bytes:
        self.service.metrics.errors.labels(str(code)).inc()
        return pack_frame("error", {"error": f"{code}: {message}", "code": str(code), "message": message}, seq)


class _Session:
    """One connection: its current episode's key into the service's chunk buffer, and its counts."""

    def __init__(self, endpoint: VlaEvalEndpoint) -> None:
        self.endpoint = endpoint
        self.service = endpoint.service
        self.episode = self._new_episode()
        self.observations = 0
        self.buffered = 0

    @staticmethod
    def _new_episode() -> str:
        return f"vla-eval-{uuid.uuid4().hex}"

    async def answer(self, frame: bytes) -> bytes | None:
        """The reply to one frame (None for those vla-eval answers with nothing)."""
        seq = 0
        try:
            message = unpackb(frame, self.service.limits)
            if not isinstance(message, dict):
                raise ProtocolError(f"a vla-eval frame must be a map {{type, payload, seq, timestamp}}, got "
                                    f"{type(message).__name__}")
            if type(message.get("seq")) is int:
                seq = message["seq"]
            missing = [key for key in ("type", "payload", "seq") if key not in message]
            if missing:
                raise ProtocolError(f"vla-eval frame is missing {', '.join(missing)}; frames are "
                                    "{type, payload, seq, timestamp}")
            kind = message["type"]
            if kind not in CLIENT_TYPES:
                raise FrameRefused(ErrorCode.UNKNOWN_TYPE, f"message type {str(kind)[:40]!r} is not one a client "
                                                           f"sends; expected one of {', '.join(CLIENT_TYPES)}")
            payload = message["payload"]
            if kind == "hello":
                return await self._hello(payload, seq)
            if kind == "observation":
                return await self._observation(payload, seq)
            self._end_episode("ended" if kind == "episode_end" else "ended by the next episode_start")
            return None
        except FrameRefused as exc:
            return self.endpoint.error_frame(seq, exc.code, exc.message)
        except RequestError as exc:
            return self.endpoint.error_frame(seq, exc.code, exc.message)
        except InvalidImage as exc:
            return self.endpoint.error_frame(seq, ErrorCode.INVALID_IMAGE, str(exc))
        except InvalidObservation as exc:
            return self.endpoint.error_frame(seq, ErrorCode.INVALID_OBSERVATION, str(exc))
        except ProtocolError as exc:
            return self.endpoint.error_frame(seq, ErrorCode.BAD_FRAME, str(exc))
        except Exception:
            log.exception("internal error while answering vla-eval frame seq %s", seq)
            return self.endpoint.error_frame(seq, ErrorCode.INTERNAL, "internal server error; see the server's log")

    async def _hello(self, payload: Any, seq: int) -> bytes:
        version = payload.get("protocol_version") if isinstance(payload, dict) else None
        if version is not None and version != VLA_EVAL_PROTOCOL_VERSION:
            raise FrameRefused(ErrorCode.PROTOCOL_VERSION, f"client speaks vla-eval protocol version {version!r}; "
                                                           f"this server speaks {VLA_EVAL_PROTOCOL_VERSION}")
        await self.service.wait_ready()
        return pack_frame("hello", self.endpoint.hello, seq)

    async def _observation(self, payload: Any, seq: int) -> bytes:
        service = self.service
        service.metrics.requests.labels("vla_eval").inc()
        service.inflight += 1
        start = time.perf_counter()
        try:
            request = InferRequest(request_id=seq, obs=self.endpoint.observation(payload), episode_id=self.episode,
                                   step=self.observations, stepwise=True)
            reply = await service.infer(request)
        finally:
            service.inflight -= 1
        service.metrics.request_seconds.observe(time.perf_counter() - start)
        self.observations += 1
        self.buffered += int(reply.timing.get("cached", 0.0))
        return pack_frame("action", {"actions": reply.actions, "server_timing": reply.timing}, seq)

    def _end_episode(self, how: str) -> None:
        """Drop the buffered actions of the episode so far (at episode_start, episode_end and disconnect)."""
        if self.observations:
            log.info("vla-eval episode %s: served %d observations (%d from the chunk buffer); episode %s",
                     self.episode, self.observations, self.buffered, how)
        self.service.reset(ResetRequest(request_id=0, episode_id=self.episode))
        self.episode = self._new_episode()
        self.observations = self.buffered = 0

    def close(self) -> None:
        self._end_episode("left unfinished: the client disconnected")
