"""One client interface to every policy server the workers evaluate: ours, openpi's, vla-eval's.

A worker asks ``make_client(protocol, url, ...)`` for a ``PolicyAdapter`` and never
branches on the protocol again: ``connect()`` reads the server's greeting into a
``ServerInfo``, ``infer(obs)`` returns an ``ActionsReply`` whose actions are always
float32 ``[chunk, action_dim]``, ``reset(episode_id)`` starts the next episode, and
``close()`` hangs up. One module per protocol behind it:

==============  ==================================  ===========================================
protocol        client                              the server
==============  ==================================  ===========================================
``evalforge``   ``client.PolicyClient``             our ``policy-server``
``openpi``      ``openpi.OpenPiClient``             openpi's ``WebsocketPolicyServer``
``vla-eval``    ``vla_eval.VlaEvalClient``          a vla-eval model server (``PredictModelServer``)
==============  ==================================  ===========================================

All three share ``client.WebSocketAdapter``'s connection rules (``ClientSettings``:
connect deadline with backoff, per-call timeout, one reconnect after a dropped
connection, the observation resent on it) and its errors (``PolicyUnavailable``,
``PolicyTimeout``, ``PolicyError``, ``ProtocolError``).

**Observation keys.** The canonical observation (``messages.Observation``) has the
fields ``state``, ``task`` and ``images.<camera>``; a remote server wants them under
its own keys. ``observation_keys`` maps each canonical field to the server's key;
``images.*`` is the rule for every camera not mapped by name, with ``<camera>``
standing for the camera's name. A ``.`` in a server key nests (``images.<camera>``
is ``{"images": {camera: ...}}``); any other character, ``/`` included, is part of
the key (``observation/state`` is one flat key, as openpi's examples use).
``DEFAULT_OBSERVATION_KEYS`` holds each protocol's defaults; ``check_observation_keys``
merges a registration's keys over them. An ``evalforge`` server takes the canonical
observation as it is: its keys cannot be remapped.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.protocol.codec import ProtocolError
from services.protocol.messages import (
    CAMERA_NAME_PATTERN,
    MAX_CAMERAS,
    ActionsReply,
    Metadata,
    Observation,
)

if TYPE_CHECKING:
    from services.protocol.client import ClientSettings

__all__ = [
    "CAMERA_PLACEHOLDER",
    "DEFAULT_OBSERVATION_KEYS",
    "IMAGES_RULE",
    "MAX_RAW_BYTES",
    "PROTOCOLS",
    "PolicyAdapter",
    "ServerInfo",
    "check_observation_keys",
    "json_summary",
    "make_client",
    "remap_observation",
]

PROTOCOLS = ("evalforge", "openpi", "vla-eval")

MAX_RAW_BYTES = 64 * 1024
"""The cap on ``ServerInfo.raw`` as JSON: it is stored with the policy and shown by the API."""

IMAGES_RULE = "images.*"
"""The canonical field that stands for every camera not mapped by its own ``images.<camera>``."""
CAMERA_PLACEHOLDER = "<camera>"
"""In the ``images.*`` rule's server key, the place of the camera's name."""

DEFAULT_OBSERVATION_KEYS: dict[str, dict[str, str]] = {
    "evalforge": {"state": "state", "task": "task", IMAGES_RULE: "images.<camera>"},
    "openpi": {"state": "observation/state", "task": "prompt", IMAGES_RULE: "observation/<camera>"},
    "vla-eval": {"state": "state", "task": "task_description", IMAGES_RULE: "images.<camera>"},
}
"""Per protocol, canonical field → the server's key (see the module docstring for the rules)."""

MAX_SERVER_KEY_CHARS = 200


@dataclass(frozen=True)
class ServerInfo:
    """What a policy server said about itself when the client connected; None where it did not say.

    ``tasks`` () means any task (a language-conditioned policy); ``cameras`` {} means the
    server named no image sizes. ``raw`` is the server's greeting itself (our metadata, openpi's
    metadata frame, vla-eval's hello payload) made JSON-safe by ``json_summary``.
    """

    protocol: str
    policy_name: str | None
    checkpoint_sha256: str | None
    revision: str | None
    state_dim: int | None
    action_dim: int | None
    chunk_size: int | None
    tasks: tuple[str, ...] = ()
    cameras: dict[str, tuple[int, int]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, meta: Metadata) -> ServerInfo:
        """Our own handshake (an ``evalforge`` server), which names every field."""
        return cls(protocol="evalforge", policy_name=meta.policy_name, checkpoint_sha256=meta.checkpoint_sha256,
                   revision=meta.revision, state_dim=meta.state_dim, action_dim=meta.action_dim,
                   chunk_size=meta.chunk_size, tasks=meta.tasks, cameras=dict(meta.cameras),
                   raw=json_summary(meta.to_wire()))


def _json_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {(key.decode(errors="replace") if isinstance(key, bytes) else str(key)): _json_value(item)
                for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, np.ndarray):
        return {"array": {"shape": list(value.shape), "dtype": value.dtype.str}}
    if isinstance(value, np.generic):
        return _json_value(value.item())
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": len(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON (and PostgreSQL's JSONB) has no NaN or infinity
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return {"type": type(value).__name__}


def json_summary(greeting: Mapping[str, Any]) -> dict[str, Any]:
    """``greeting`` as JSON-safe values: arrays become their shape and dtype, bytes their length,
    NaN and infinity strings; over ``MAX_RAW_BYTES`` of JSON, only its first keys and its size."""
    summary = _json_value(dict(greeting))
    size = len(json.dumps(summary).encode())
    if size <= MAX_RAW_BYTES:
        return summary
    return {"truncated": True, "json_bytes": size, "keys": [key[:MAX_SERVER_KEY_CHARS] for key in list(summary)[:64]]}


def _field_error(field_name: object, protocol: str) -> ValueError:
    label = repr(field_name[:80]) if isinstance(field_name, str) else f"a {type(field_name).__name__}"
    return ValueError(f"observation_keys for protocol {protocol!r} has the field {label}, which is not a "
                      f"canonical observation field; the fields are 'state', 'task', 'images.<camera>' "
                      f"(a camera name matching {CAMERA_NAME_PATTERN.pattern}) and {IMAGES_RULE!r} "
                      "(every other camera)")


def _check_server_key(protocol: str, field_name: str, key: object) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_SERVER_KEY_CHARS or not key.isprintable():
        raise ValueError(f"observation_keys[{field_name!r}] must be a printable string of 1 to "
                         f"{MAX_SERVER_KEY_CHARS} characters: the key the {protocol} server reads it from")
    if "" in key.split("."):
        raise ValueError(f"observation_keys[{field_name!r}] = {key!r} has an empty part between dots; a dot "
                         "nests (images.front is {'images': {'front': ...}})")
    placeholders = key.count(CAMERA_PLACEHOLDER)
    if field_name == IMAGES_RULE and placeholders != 1:
        raise ValueError(f"observation_keys[{IMAGES_RULE!r}] = {key!r} must hold {CAMERA_PLACEHOLDER!r} once, "
                         "where each camera's name goes (e.g. 'observation/<camera>')")
    if field_name != IMAGES_RULE and placeholders:
        raise ValueError(f"observation_keys[{field_name!r}] = {key!r} holds {CAMERA_PLACEHOLDER!r}, which only "
                         f"the {IMAGES_RULE!r} rule may use")
    return key


def check_observation_keys(protocol: str, keys: Mapping[str, str] | None) -> dict[str, str]:
    """The complete key map for ``protocol``: its defaults with ``keys`` (a registration's) over them.

    Raises ``ValueError`` naming the problem: an unknown protocol or canonical field, a server key
    that is not a printable string, two fields sent to the same key (or one inside the other), or
    any keys at all for ``evalforge``, whose observation is canonical.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown policy protocol {str(protocol)[:40]!r}; the protocols are {', '.join(PROTOCOLS)}")
    keys = dict(keys or {})
    if protocol == "evalforge" and keys:
        raise ValueError("observation_keys apply to openpi and vla-eval servers; an evalforge policy server "
                         "takes the canonical observation as it is: leave observation_keys out")
    if len(keys) > MAX_CAMERAS + 3:
        raise ValueError(f"observation_keys has {len(keys)} entries; at most {MAX_CAMERAS + 3} (state, task, "
                         f"{IMAGES_RULE} and {MAX_CAMERAS} cameras)")
    for field_name, key in keys.items():
        if not isinstance(field_name, str):
            raise _field_error(field_name, protocol)
        camera = field_name.removeprefix("images.") if field_name.startswith("images.") else None
        if field_name not in ("state", "task", IMAGES_RULE) and not (
                camera is not None and CAMERA_NAME_PATTERN.fullmatch(camera)):
            raise _field_error(field_name, protocol)
        _check_server_key(protocol, field_name, key)
    merged = {**DEFAULT_OBSERVATION_KEYS[protocol], **keys}
    fixed = {field_name: key for field_name, key in merged.items() if field_name != IMAGES_RULE}
    seen: dict[tuple[str, ...], str] = {}
    for field_name, key in fixed.items():
        path = tuple(key.split("."))
        for other_path, other in seen.items():
            if _overlap(path, other_path):
                how = "the same key" if len(path) == len(other_path) else "keys inside one another"
                raise ValueError(f"observation_keys sends {other!r} and {field_name!r} to {how} "
                                 f"({'.'.join(other_path)!r}, {key!r}); give each field a key of its own")
        seen[path] = field_name
    return merged


def _overlap(path: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """Whether two server keys (split at their dots) are the same or one lies inside the other."""
    shorter = min(len(path), len(other))
    return path[:shorter] == other[:shorter]


def _place(request: dict[str, Any], path: tuple[str, ...], value: Any, field_name: str,
           placed: dict[tuple[str, ...], str]) -> None:
    for other_path, other in placed.items():
        if _overlap(path, other_path):
            raise ProtocolError(f"observation fields {other!r} and {field_name!r} land on the same server key "
                                f"({'.'.join(other_path)!r}, {'.'.join(path)!r}) under these observation_keys; "
                                f"map {field_name!r} to a key of its own")
    node = request
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    placed[path] = field_name


def remap_observation(obs: Observation, keys: Mapping[str, str]) -> dict[str, Any]:
    """The request a remote server gets for ``obs``: each field under its key in ``keys`` (a map
    ``check_observation_keys`` returned). The state goes as float32, images as sent (checked
    uint8 ``[H, W, 3]``); raises ``ProtocolError`` when the ``images.*`` rule puts a camera on a
    key another field already has."""
    canonical = obs.to_wire()  # (checks every image)
    request: dict[str, Any] = {}
    placed: dict[tuple[str, ...], str] = {}
    _place(request, tuple(keys["state"].split(".")), canonical["state"], "state", placed)
    _place(request, tuple(keys["task"].split(".")), canonical["task"], "task", placed)
    for camera, image in canonical.get("images", {}).items():
        field_name = f"images.{camera}"
        key = keys.get(field_name)
        # The camera's name replaces the placeholder within one part: a camera named "a.b" stays one key.
        path = tuple(key.split(".")) if key is not None else tuple(
            part.replace(CAMERA_PLACEHOLDER, camera) for part in keys[IMAGES_RULE].split("."))
        _place(request, path, image, field_name, placed)
    return request


class PolicyAdapter(ABC):
    """A connection to one policy server, whatever its protocol (``protocol``, one of ``PROTOCOLS``).

    Blocking, one call at a time. ``connect`` is optional: ``info`` and ``infer`` connect on first
    use. Used as a context manager, it connects on entry and closes on exit.
    """

    protocol: str
    url: str

    @abstractmethod
    def connect(self) -> ServerInfo:
        """Connect (retrying until the settings' deadline) and read the server's greeting."""

    @property
    @abstractmethod
    def info(self) -> ServerInfo:
        """The server's greeting, connecting first if no connection was made yet."""

    @abstractmethod
    def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None,
              step: int = 0) -> ActionsReply:
        """The action chunk for ``obs``: ``actions`` float32 ``[chunk, action_dim]``."""

    @abstractmethod
    def reset(self, episode_id: str | None = None) -> None:
        """Forget the current episode on the server's side; the next ``infer`` starts ``episode_id``."""

    @abstractmethod
    def close(self) -> None:
        """Hang up (a later call connects again)."""

    def __enter__(self) -> PolicyAdapter:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_client(protocol: str, url: str, settings: ClientSettings | None = None, *,
                observation_keys: Mapping[str, str] | None = None, expected_checkpoint: str | None = None,
                action_dim: int | None = None) -> PolicyAdapter:
    """The client for a ``protocol`` server at ``url`` (not connected yet).

    ``observation_keys``: a registration's keys (remote protocols; see ``check_observation_keys``).
    ``expected_checkpoint``: a sha256 or revision every connection's greeting must name (a remote
    server that names none is taken as it is). ``action_dim``: the width every reply of a remote
    server must have (an evalforge server declares its own). Raises ``ValueError`` for an unknown
    protocol or bad keys.
    """
    keys = check_observation_keys(protocol, observation_keys)
    # (Imported here: the three client modules import this one for the interface they implement.)
    if protocol == "evalforge":
        from services.protocol.client import PolicyClient

        return PolicyClient(url, settings, expected_checkpoint=expected_checkpoint)
    if protocol == "openpi":
        from services.protocol.openpi import OpenPiClient

        return OpenPiClient(url, settings, observation_keys=keys, expected_checkpoint=expected_checkpoint,
                            action_dim=action_dim)
    from services.protocol.vla_eval import VlaEvalClient

    return VlaEvalClient(url, settings, observation_keys=keys, expected_checkpoint=expected_checkpoint,
                         action_dim=action_dim)
