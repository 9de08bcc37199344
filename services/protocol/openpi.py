"""Client of openpi's ``WebsocketPolicyServer`` (pi0, pi0-FAST, pi05 and whatever else openpi serves).

openpi's protocol, as its ``openpi_server.websocket_policy_server`` speaks it: on connect the
server sends one msgpack frame of metadata, which may hold anything (often ``{}``); then
every request is a bare observation dict under the server's own keys, and every reply a
dict with ``actions`` (``[chunk, action_dim]``, or ``[action_dim]`` for one action) and
``server_timing``. When the policy raises, the server sends the traceback as a text frame
and closes the connection. Arrays travel as openpi's ``msgpack_numpy`` packs them, which
is our codec's format. There is no reset message (openpi servers keep no episode state).

What this client makes of it:

- the observation is sent under the registration's ``observation_keys`` (defaults:
  ``adapters.DEFAULT_OBSERVATION_KEYS["openpi"]``, LIBERO's ``observation/state``,
  ``observation/<camera>`` and ``prompt``), state as float32, images as uint8 arrays;
- ``ServerInfo`` takes from the metadata only the fields it names with our names and right
  types (``policy_name``, ``checkpoint_sha256``, ``revision``, ``state_dim``, ``action_dim``,
  ``chunk_size``, ``tasks``); the rest stays in ``raw``;
- replies are held to ``checked_actions`` (``PolicyError("invalid_actions")``); a traceback
  frame becomes ``PolicyError("server_error", <its exception line>)``, never the traceback;
- requests carry no id, so a reply that comes after its call timed out would be taken for
  the next call's: a timeout therefore closes the connection (the next call reconnects).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

from websockets.sync.client import ClientConnection

from services.protocol.adapters import (
    ServerInfo,
    check_observation_keys,
    json_summary,
    remap_observation,
)
from services.protocol.client import (
    ClientSettings,
    PolicyTimeout,
    WebSocketAdapter,
    _as_observation,
    _check_checkpoint,
    checked_actions,
    server_error,
)
from services.protocol.codec import ProtocolError, packb, unpackb
from services.protocol.messages import (
    MAX_POLICY_NAME_CHARS,
    MAX_TASK_NAME_CHARS,
    MAX_TASKS,
    REVISION_PATTERN,
    SHA256_PATTERN,
    ActionsReply,
    Observation,
)

__all__ = ["OpenPiClient", "server_info_from_openpi"]

MAX_DIM = 1 << 16  # a declared dimension above this is not taken for one


def _declared_int(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return value if type(value) is int and 0 < value <= MAX_DIM else None


def _declared_text(meta: Mapping[str, Any], key: str, ok: Any) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) and ok(value) else None


def server_info_from_openpi(meta: Mapping[str, Any]) -> ServerInfo:
    """What an openpi metadata frame says in our terms: the fields it names as ours, with the right
    types (a field named otherwise, or mistyped, is None); the whole frame in ``raw``."""
    tasks = meta.get("tasks")
    if not (isinstance(tasks, list) and len(tasks) <= MAX_TASKS
            and all(isinstance(t, str) and 0 < len(t) <= MAX_TASK_NAME_CHARS and t.isprintable() for t in tasks)):
        tasks = []
    return ServerInfo(
        protocol="openpi",
        policy_name=_declared_text(meta, "policy_name",
                                   lambda v: 0 < len(v) <= MAX_POLICY_NAME_CHARS and v.isprintable()),
        checkpoint_sha256=_declared_text(meta, "checkpoint_sha256", SHA256_PATTERN.fullmatch),
        revision=_declared_text(meta, "revision", REVISION_PATTERN.fullmatch),
        state_dim=_declared_int(meta, "state_dim"),
        action_dim=_declared_int(meta, "action_dim"),
        chunk_size=_declared_int(meta, "chunk_size"),
        tasks=tuple(tasks),
        raw=json_summary(meta),
    )


class OpenPiClient(WebSocketAdapter):
    """Blocking client of an openpi ``WebsocketPolicyServer``; see the module docstring.

    ``observation_keys``: canonical field → the server's key (``check_observation_keys``; None
    takes openpi's defaults). ``expected_checkpoint``: checked against the metadata's
    ``checkpoint_sha256``/``revision`` when it names one. ``action_dim``: the width every reply
    must have (else the metadata's ``action_dim``, if any).
    """

    protocol = "openpi"
    server_kind = "an openpi policy server"
    start_hint = ("check that the openpi server (scripts/serve_policy.py, openpi's WebsocketPolicyServer) "
                  "is running there and reachable")

    def __init__(self, url: str, settings: ClientSettings | None = None, *,
                 observation_keys: Mapping[str, str] | None = None, expected_checkpoint: str | None = None,
                 action_dim: int | None = None) -> None:
        super().__init__(url, settings)
        self.observation_keys = check_observation_keys("openpi", observation_keys)
        self.expected_checkpoint = expected_checkpoint
        self.action_dim = action_dim
        self._ids = itertools.count(1)

    def __enter__(self) -> OpenPiClient:
        self.connect()
        return self

    def _greet(self, ws: ClientConnection, deadline: float) -> ServerInfo:
        frame = ws.recv(timeout=max(deadline - time.monotonic(), 0.0))
        if isinstance(frame, str):
            raise ProtocolError("the openpi server's first frame is text; an openpi server sends a msgpack "
                                "metadata map first")
        try:
            meta = unpackb(frame, self.settings.limits)
        except ProtocolError:
            raise ProtocolError("the openpi server's first frame is not a msgpack metadata map") from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"the openpi server's metadata is a msgpack {type(meta).__name__}; openpi servers "
                                "send a map")
        info = server_info_from_openpi(meta)
        _check_checkpoint(self.url, self.expected_checkpoint, info.checkpoint_sha256, info.revision)
        return info

    def _exchange(self, ws: ClientConnection, request: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        deadline = time.monotonic() + self.settings.call_timeout_s
        ws.send(packb(request))
        try:
            frame = self._recv(ws, deadline)
        except PolicyTimeout:
            self.close()  # its late reply would be read as the next call's
            raise
        if isinstance(frame, str):
            self.close()  # (the server closes after its traceback)
            raise server_error(frame)
        reply = unpackb(frame, self.settings.limits)
        if not isinstance(reply, dict) or "actions" not in reply:
            raise ProtocolError("the openpi server's reply is not a map with 'actions'")
        timing = reply.get("server_timing")
        timing = {str(k): float(v) for k, v in timing.items()
                  if isinstance(v, int | float) and not isinstance(v, bool)} if isinstance(timing, dict) else {}
        return reply["actions"], timing

    def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None,
              step: int = 0) -> ActionsReply:
        """The action chunk for ``obs`` (``episode_id`` and ``step`` are not sent: openpi has no episodes)."""
        request = remap_observation(_as_observation(obs), self.observation_keys)
        actions, timing = self._call(lambda ws: self._exchange(ws, request))
        action_dim = self.action_dim if self.action_dim is not None else self.info.action_dim
        return ActionsReply(request_id=next(self._ids), actions=checked_actions(actions, action_dim), timing=timing)

    def reset(self, episode_id: str | None = None) -> None:
        """Nothing to do: an openpi server keeps no state between requests and has no reset message."""
