"""Message types of the policy wire protocol (version ``PROTOCOL_VERSION``).

One WebSocket carries binary MessagePack frames (see ``codec``). On connect the
server sends one ``Metadata`` frame. After that the client sends requests and the
server answers each with a reply carrying the same ``request_id``:

====================  =========================================================
request               reply
====================  =========================================================
``infer``             ``actions`` (float32 ``[chunk, action_dim]``) or ``error``
``reset``             ``pong`` once the episode's server-side state is cleared
``ping``              ``pong``
bare observation      ``{"actions": ..., "server_timing": {...}}`` (openpi form)
====================  =========================================================

A request may carry ``protocol_version``; a server speaking another version
answers ``error`` with code ``protocol_version``. Errors never carry tracebacks.

**Cameras.** An observation carries ``images: {camera: uint8[H, W, 3]}`` (C-contiguous,
RGB, upright), arrays as the codec sends them. A policy that sees images announces
them in its metadata, ``"cameras": {camera: [H, W]}`` (absent for a state-only
policy, so metadata frames from before cameras still parse: the field is optional and
the protocol version is unchanged). ``Observation.check_images`` holds an observation
to such a declaration; images are never converted (a float image is refused, not
rescaled), and a bad one raises ``InvalidImage`` naming the camera, the expected
``[H, W, 3]`` uint8 and what came — answered with code ``invalid_image``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from services.protocol.codec import ProtocolError

__all__ = [
    "CAMERA_NAME_PATTERN",
    "PROTOCOL_VERSION",
    "ActionsReply",
    "BareObservationRequest",
    "ErrorCode",
    "ErrorReply",
    "InferRequest",
    "InvalidImage",
    "InvalidObservation",
    "MAX_CAMERAS",
    "MAX_IMAGE_SIDE",
    "MAX_METADATA_BYTES",
    "MAX_POLICY_NAME_CHARS",
    "MAX_TASK_NAME_CHARS",
    "MAX_TASKS",
    "Metadata",
    "Observation",
    "PingRequest",
    "PongReply",
    "ProtocolVersionMismatch",
    "Reply",
    "Request",
    "ResetRequest",
    "UnknownMessageType",
    "parse_reply",
    "parse_request",
]

PROTOCOL_VERSION = 1

# Caps on the handshake a client accepts: what a server announces is stored per policy
# and listed to anyone, so it must stay small (a real policy knows tens of tasks).
MAX_METADATA_BYTES = 1024 * 1024  # the whole metadata frame
MAX_TASKS = 4096
MAX_TASK_NAME_CHARS = 200
MAX_POLICY_NAME_CHARS = 200
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
"""A checkpoint's identity: its sha256, 64 lower-case hex digits (what ``policy_format.checkpoint_digest`` makes)."""
REVISION_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""An optional ``revision`` (a git tag or commit, a hub revision) a server may name besides its sha256."""
# Caps on the cameras a policy announces (policy_format's card holds the same ones: a card the
# trainer writes is always one a server can announce; tests/policy_server checks they agree).
MAX_CAMERAS = 16
MAX_IMAGE_SIDE = 4096
CAMERA_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A camera's name, in metadata and as a key of an observation's ``images``."""


class ErrorCode(StrEnum):
    """Machine-readable reasons in ``error`` replies."""

    BAD_REQUEST = "bad_request"  # malformed message: missing or mistyped field
    BAD_FRAME = "bad_frame"  # undecodable frame, text frame, frame over the cap
    INVALID_OBSERVATION = "invalid_observation"  # wrong state shape/dtype, NaN/inf
    INVALID_IMAGE = "invalid_image"  # a camera the policy needs is missing, or its image is not uint8 [H, W, 3]
    UNKNOWN_TASK = "unknown_task"
    UNKNOWN_TYPE = "unknown_type"
    PROTOCOL_VERSION = "protocol_version"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


class ProtocolVersionMismatch(ProtocolError):
    """A peer declared a protocol version other than ``PROTOCOL_VERSION``."""


class UnknownMessageType(ProtocolError):
    """A message whose ``type`` this side does not know."""


class InvalidObservation(ProtocolError):
    """A well-formed request whose observation is unusable (shape, dtype, NaN...)."""


class InvalidImage(InvalidObservation):
    """An observation's image that is missing or not what the policy takes; ``camera`` names it."""

    def __init__(self, camera: str, message: str) -> None:
        super().__init__(message)
        self.camera = camera

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickles whole (a worker's error may cross processes)
        return InvalidImage, (self.camera, str(self))


def _camera_label(name: object) -> str:
    """A camera name as an error quotes it: a peer's key may be anything, so at most 64 characters."""
    return repr(name[:64]) if isinstance(name, str) else f"<{type(name).__name__} key>"


def _describe(value: object) -> str:
    """What an image turned out to be, in a few words (never its contents)."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    return f"a {type(value).__name__}"


def _shape_ok(image: np.ndarray, expected: tuple[int, int] | None) -> bool:
    if expected is not None:
        return image.shape == (expected[0], expected[1], 3)
    return image.ndim == 3 and image.shape[2] == 3 and 0 not in image.shape


def _check_image(camera: str, image: object, expected: tuple[int, int] | None) -> None:
    """Raise ``InvalidImage`` unless ``image`` is uint8 [H, W, 3], C-contiguous (and [h, w, 3] when expected)."""
    if (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.flags.c_contiguous
            and _shape_ok(image, expected)):
        return  # (the messages below are built only for a bad image: this runs for every image sent)
    want = "uint8 [H, W, 3]" if expected is None else f"uint8 [{expected[0]}, {expected[1]}, 3]"
    label = _camera_label(camera)
    if not isinstance(image, np.ndarray):
        raise InvalidImage(camera, f"image of camera {label} must be a {want} array, got {_describe(image)}")
    if image.dtype != np.uint8:
        raise InvalidImage(camera, f"image of camera {label} must be {want}, got {_describe(image)}; images are "
                                   "never converted (a float image is refused, not rescaled): send uint8 0-255")
    if not _shape_ok(image, expected):
        fix = f"render it at {expected[0]}x{expected[1]} RGB" if expected is not None else "send RGB height x width x 3"
        raise InvalidImage(camera, f"image of camera {label} must be {want}, got {_describe(image)}; {fix}")
    raise InvalidImage(camera, f"image of camera {label} must be a C-contiguous {want} array, got a strided "
                               "view; pass numpy.ascontiguousarray(image)")


def _require(msg: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in msg:
        raise ProtocolError(f"{what} is missing the '{key}' field")
    value = msg[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(f"{what} field '{key}' must be {names}, got {type(value).__name__}")
    return value


def _request_id(msg: dict, what: str) -> int | str:
    value = _require(msg, "request_id", (int, str), what)
    if isinstance(value, bool):
        raise ProtocolError(f"{what} field 'request_id' must be int or str, got bool")
    return value


@dataclass(frozen=True, slots=True)
class Observation:
    """The canonical observation: a float32 state vector, a task name, optional images.

    ``images`` maps camera names to uint8 [H, W, 3] C-contiguous arrays (``to_wire`` and
    ``from_wire`` refuse anything else with ``InvalidImage``).
    """

    state: np.ndarray
    task: str
    images: dict[str, np.ndarray] = field(default_factory=dict)

    def check_images(self, expected: Mapping[str, tuple[int, int]]) -> None:
        """Raise ``InvalidImage`` unless every camera in ``expected`` (name → (height, width)) has a
        C-contiguous uint8 [height, width, 3] image here; cameras not in ``expected`` are ignored."""
        for camera, size in expected.items():
            if camera not in self.images:
                sent = ", ".join(_camera_label(name) for name in list(self.images)[:MAX_CAMERAS]) or "none"
                raise InvalidImage(camera, f"observation has no image of camera {camera!r}, which this policy "
                                           f"needs as uint8 [{size[0]}, {size[1]}, 3] under 'images'; "
                                           f"cameras sent: {sent}")
            _check_image(camera, self.images[camera], (size[0], size[1]))

    @classmethod
    def from_wire(cls, obs: Any, cameras: Mapping[str, tuple[int, int]] | None = None) -> Observation:
        """The observation in a decoded ``obs`` map; with ``cameras`` (what the policy takes), its images are
        held to them (``check_images``) before any other image is checked."""
        if not isinstance(obs, dict):
            raise InvalidObservation(f"'obs' must be a map, got {type(obs).__name__}")
        state = obs.get("state")
        if state is None:
            raise InvalidObservation("observation is missing the 'state' field")
        if not isinstance(state, np.ndarray):
            raise InvalidObservation(f"observation field 'state' must be an array, got {type(state).__name__}")
        if state.dtype != np.float32 or state.ndim != 1:
            raise InvalidObservation(
                f"observation field 'state' must be float32 of shape [D], got {state.dtype} of shape {list(state.shape)}"
            )
        if not np.isfinite(state).all():
            raise InvalidObservation("observation field 'state' contains NaN or infinity")
        task = obs.get("task")
        if not isinstance(task, str):
            raise InvalidObservation(f"observation field 'task' must be a string, got {type(task).__name__}")
        images = obs.get("images")
        if images is None:
            images = {}
        if not isinstance(images, dict):
            raise InvalidObservation(f"observation field 'images' must map camera names to uint8 [H, W, 3] arrays, "
                                     f"got {type(images).__name__}")
        observation = cls(state=state, task=task, images=images)
        if cameras:
            observation.check_images(cameras)
        for camera, image in images.items():
            if cameras and camera in cameras:
                continue
            if not isinstance(camera, str):
                raise InvalidObservation(f"observation field 'images' has a {type(camera).__name__} key; camera "
                                         "names are strings")
            _check_image(camera, image, None)
        return observation

    def to_wire(self) -> dict[str, Any]:
        """The ``obs`` map to send; raises ``InvalidImage`` for an image the protocol does not carry."""
        wire: dict[str, Any] = {"state": np.ascontiguousarray(self.state, dtype=np.float32), "task": self.task}
        if self.images:
            for camera, image in self.images.items():
                _check_image(camera, image, None)
            wire["images"] = self.images
        return wire


@dataclass(frozen=True, slots=True)
class Metadata:
    """The handshake frame a server sends first on every connection."""

    policy_name: str
    checkpoint_sha256: str
    state_dim: int
    action_dim: int
    chunk_size: int
    tasks: tuple[str, ...]
    protocol_version: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    revision: str | None = None
    cameras: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The images the policy takes, name → (height, width), in the policy's order; {} for a state-only one."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "metadata",
            "protocol_version": self.protocol_version,
            "policy_name": self.policy_name,
            "checkpoint_sha256": self.checkpoint_sha256,
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "chunk_size": self.chunk_size,
            "tasks": list(self.tasks),
            **({"extra": self.extra} if self.extra else {}),
            **({"revision": self.revision} if self.revision is not None else {}),
            **({"cameras": {name: [h, w] for name, (h, w) in self.cameras.items()}} if self.cameras else {}),
        }

    @classmethod
    def from_wire(cls, msg: Any) -> Metadata:
        what = "metadata frame"
        if not isinstance(msg, dict) or msg.get("type") != "metadata":
            raise ProtocolError("the first frame from a policy server must be its metadata (type 'metadata')")
        version = _require(msg, "protocol_version", int, what)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"policy server speaks protocol version {version}, this client speaks {PROTOCOL_VERSION}; "
                "upgrade whichever side is older"
            )
        # Errors name fields and sizes, never quote the peer's strings: they reach users.
        tasks = _require(msg, "tasks", list, what)
        if not all(isinstance(t, str) for t in tasks):
            raise ProtocolError("metadata field 'tasks' must be a list of strings")
        if not 1 <= len(tasks) <= MAX_TASKS:
            raise ProtocolError(f"metadata field 'tasks' has {len(tasks)} entries; a policy server announces "
                                f"1 to {MAX_TASKS} tasks")
        if not all(0 < len(t) <= MAX_TASK_NAME_CHARS and t.isprintable() for t in tasks):
            raise ProtocolError(f"metadata field 'tasks' holds a name that is empty, over {MAX_TASK_NAME_CHARS} "
                                "characters or not printable")
        policy_name = _require(msg, "policy_name", str, what)
        if not 0 < len(policy_name) <= MAX_POLICY_NAME_CHARS or not policy_name.isprintable():
            raise ProtocolError(f"metadata field 'policy_name' is empty, over {MAX_POLICY_NAME_CHARS} characters "
                                "or not printable")
        sha256 = _require(msg, "checkpoint_sha256", str, what)
        if not SHA256_PATTERN.fullmatch(sha256):
            raise ProtocolError("metadata field 'checkpoint_sha256' is not a sha256 (64 lower-case hex digits)")
        revision = msg.get("revision")
        if revision is not None and not (isinstance(revision, str) and REVISION_PATTERN.fullmatch(revision)):
            raise ProtocolError("metadata field 'revision' must match [A-Za-z0-9._-]{1,64}")
        extra = msg.get("extra", {})
        return cls(
            policy_name=policy_name,
            checkpoint_sha256=sha256,
            state_dim=_require(msg, "state_dim", int, what),
            action_dim=_require(msg, "action_dim", int, what),
            chunk_size=_require(msg, "chunk_size", int, what),
            tasks=tuple(tasks),
            protocol_version=version,
            extra=extra if isinstance(extra, dict) else {},
            revision=revision,
            cameras=_metadata_cameras(msg.get("cameras", {})),
        )


def _metadata_cameras(cameras: Any) -> dict[str, tuple[int, int]]:
    """The handshake's ``cameras`` map, checked against the caps (a missing field is {})."""
    if not isinstance(cameras, dict):
        raise ProtocolError(f"metadata field 'cameras' must map camera names to [height, width], got "
                            f"{type(cameras).__name__}")
    if len(cameras) > MAX_CAMERAS:
        raise ProtocolError(f"metadata field 'cameras' names {len(cameras)} cameras; a policy takes at most "
                            f"{MAX_CAMERAS}")
    sizes: dict[str, tuple[int, int]] = {}
    for name, size in cameras.items():
        if not isinstance(name, str) or not CAMERA_NAME_PATTERN.fullmatch(name):
            raise ProtocolError("metadata field 'cameras' has a camera name that does not match "
                                f"{CAMERA_NAME_PATTERN.pattern}")
        if (not isinstance(size, list) or len(size) != 2
                or not all(type(side) is int and 1 <= side <= MAX_IMAGE_SIDE for side in size)):
            raise ProtocolError(f"metadata camera {name!r} must be [height, width], integers from 1 to "
                                f"{MAX_IMAGE_SIDE}")
        sizes[name] = (size[0], size[1])
    return sizes


@dataclass(frozen=True, slots=True)
class InferRequest:
    request_id: int | str
    obs: Observation
    episode_id: str | None = None
    step: int = 0
    # Ask for one action row at a time, served from a server-side chunk cache.
    stepwise: bool = False
    # Sampling: greedy (temperature 0) unless the request says otherwise.
    temperature: float = 0.0
    seed: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "type": "infer",
            "protocol_version": PROTOCOL_VERSION,
            "request_id": self.request_id,
            "episode_id": self.episode_id,
            "step": self.step,
            "obs": self.obs.to_wire(),
        }
        if self.stepwise:
            wire["stepwise"] = True
        if self.temperature:
            wire["temperature"] = self.temperature
        if self.seed is not None:
            wire["seed"] = self.seed
        return wire


@dataclass(frozen=True, slots=True)
class ResetRequest:
    request_id: int | str
    episode_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"type": "reset", "protocol_version": PROTOCOL_VERSION, "request_id": self.request_id,
                "episode_id": self.episode_id}


@dataclass(frozen=True, slots=True)
class PingRequest:
    request_id: int | str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "ping", "protocol_version": PROTOCOL_VERSION, "request_id": self.request_id}


@dataclass(frozen=True, slots=True)
class BareObservationRequest:
    """An openpi-style request: the observation dict itself, with no envelope."""

    obs: dict[str, Any]


Request = InferRequest | ResetRequest | PingRequest | BareObservationRequest


@dataclass(frozen=True, slots=True)
class ActionsReply:
    request_id: int | str
    actions: np.ndarray  # float32 [chunk, action_dim], or [action_dim] for stepwise requests
    timing: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "actions", "request_id": self.request_id, "actions": self.actions, "timing": self.timing}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    request_id: int | str | None
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "error", "request_id": self.request_id, "code": str(self.code), "message": self.message}


@dataclass(frozen=True, slots=True)
class PongReply:
    request_id: int | str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "pong", "request_id": self.request_id}


Reply = ActionsReply | ErrorReply | PongReply


def _check_version(msg: dict) -> None:
    version = msg.get("protocol_version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionMismatch(
            f"request speaks protocol version {version!r}, this server speaks {PROTOCOL_VERSION}"
        )


def parse_request(msg: Any, cameras: Mapping[str, tuple[int, int]] | None = None) -> Request:
    """Validate a decoded frame from a client and return the request it carries.

    ``cameras``: the images the serving policy takes (name → (height, width)); an infer request's
    observation is held to them (``Observation.from_wire``). A bare (openpi-style) request is
    returned as sent: the server reads its observation itself.
    """
    if not isinstance(msg, dict):
        raise ProtocolError(f"a request must be a map, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind is None:
        if not msg:
            raise ProtocolError("empty request")
        return BareObservationRequest(obs=msg)
    _check_version(msg)
    if kind == "infer":
        what = "infer request"
        episode_id = msg.get("episode_id")
        if episode_id is not None and not isinstance(episode_id, str | int):
            raise ProtocolError(f"{what} field 'episode_id' must be a string, got {type(episode_id).__name__}")
        step = msg.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ProtocolError(f"{what} field 'step' must be a non-negative integer, got {step!r}")
        temperature = msg.get("temperature", 0.0)
        if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
            raise ProtocolError(f"{what} field 'temperature' must be a number in [0, 2], got {temperature!r}")
        seed = msg.get("seed")
        if seed is not None and (type(seed) is not int or seed < 0):
            raise ProtocolError(f"{what} field 'seed' must be a non-negative integer, got {seed!r}")
        request_id = _request_id(msg, what)
        if "obs" not in msg:
            raise ProtocolError(f"{what} is missing the 'obs' field")
        return InferRequest(
            request_id=request_id,
            obs=Observation.from_wire(msg["obs"], cameras),
            episode_id=None if episode_id is None else str(episode_id),
            step=step,
            stepwise=bool(msg.get("stepwise", False)),
            temperature=float(temperature),
            seed=seed,
        )
    if kind == "reset":
        episode_id = msg.get("episode_id")
        return ResetRequest(request_id=_request_id(msg, "reset request"),
                            episode_id=None if episode_id is None else str(episode_id))
    if kind == "ping":
        return PingRequest(request_id=_request_id(msg, "ping request"))
    raise UnknownMessageType(f"unknown request type {str(kind)[:40]!r}; expected infer, reset or ping")


def parse_reply(msg: Any) -> Reply:
    """Validate a decoded frame from a server and return the reply it carries."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a reply must be a map, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind == "actions":
        actions = msg.get("actions")
        if not isinstance(actions, np.ndarray) or actions.dtype != np.float32 or actions.ndim not in (1, 2):
            raise ProtocolError("actions reply field 'actions' must be a float32 array of shape [chunk, action_dim]")
        timing = msg.get("timing") or {}
        if not isinstance(timing, dict):
            raise ProtocolError("actions reply field 'timing' must be a map")
        return ActionsReply(request_id=_request_id(msg, "actions reply"), actions=actions, timing=timing)
    if kind == "error":
        code = msg.get("code")
        message = msg.get("message")
        if not isinstance(code, str) or not isinstance(message, str):
            raise ProtocolError("error reply must carry string fields 'code' and 'message'")
        request_id = msg.get("request_id")
        return ErrorReply(request_id=request_id, code=code, message=message)
    if kind == "pong":
        return PongReply(request_id=_request_id(msg, "pong reply"))
    if kind is None and "actions" in msg:
        raise ProtocolError("got an openpi-style reply to an enveloped request")
    raise UnknownMessageType(f"unknown reply type {str(kind)[:40]!r}; expected actions, error or pong")
