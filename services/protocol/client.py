"""Policy clients: synchronous (``PolicyClient``) and asyncio (``AsyncPolicyClient``).

Both connect directly (never through an HTTP proxy, never following an HTTP
redirect) with exponential backoff and full jitter until an overall deadline, read
and check the server's metadata frame (at most ``MAX_METADATA_BYTES``), time out each
call, reconnect once after a dropped connection and retry the call, and raise typed
errors:

- ``PolicyUnavailable``: no server answered before the connect deadline. Only what
  can succeed later is retried (a refused or dropped connection, a timeout, an HTTP
  5xx); an unknown host, a TLS failure or another HTTP answer (a plain web service,
  a redirect, a 4xx) fail at once. The message says which in a few words and never
  quotes what the peer sent (its headers or body may hold secrets), so that a URL a
  user typed cannot be used to read another service;
- ``PolicyTimeout``: a call got no reply within its timeout;
- ``PolicyError``: the server answered with an ``error`` reply (``.code`` says why);
- ``ProtocolError``: a frame or message broke the protocol (including a protocol
  version mismatch, which is never retried).

``WebSocketAdapter`` is that connection machinery for every synchronous client:
``PolicyClient`` (ours) and the openpi and vla-eval clients (``openpi``,
``vla_eval``) differ only in their greeting and their frames. ``checked_actions`` and
``server_error`` are the reply checks of the remote protocols.

The asyncio client multiplexes: many calls may be in flight on one connection,
and replies are matched to calls by ``request_id``.

``ActionChunkBroker`` (and its asyncio twin) executes an action chunk one step at
a time and asks the server for the next chunk only when the current one is used
up, like openpi's broker of the same name.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import socket
import ssl
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as _AsyncConnect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection as SyncConnection
from websockets.sync.client import reconnect as _SyncConnect

from services.protocol.adapters import PolicyAdapter, ServerInfo
from services.protocol.codec import DEFAULT_LIMITS, Limits, ProtocolError, packb, unpackb
from services.protocol.messages import (
    MAX_METADATA_BYTES,
    ActionsReply,
    ErrorReply,
    InferRequest,
    Metadata,
    Observation,
    PingRequest,
    Reply,
    ResetRequest,
    parse_reply,
)

__all__ = [
    "ActionChunkBroker",
    "AsyncActionChunkBroker",
    "AsyncPolicyClient",
    "CheckpointMismatch",
    "ClientSettings",
    "PolicyClient",
    "PolicyError",
    "PolicyTimeout",
    "PolicyUnavailable",
    "ProtocolError",
    "WebSocketAdapter",
    "backoff_delays",
    "checked_actions",
    "latency_summary_ms",
    "server_error",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT = (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, EOFError)


class PolicyUnavailable(ConnectionError):
    """No policy server could be reached before the connect deadline.

    ``reason`` is one of the ``REFUSED`` … ``NOT_A_POLICY_SERVER`` phrases below.
    """

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


# What a connection failure is called, in the words a user needs and no more: an open
# port that is no policy server, a filtered one and a silent one read the same.
REFUSED = "the connection was refused"
UNKNOWN_HOST = "the host name is unknown"
TLS_FAILED = "the TLS handshake failed"
NOT_A_POLICY_SERVER = "nothing answered as a policy server"


class _NoRedirectSync(_SyncConnect):
    """websockets' sync connector, minus following redirects (a redirect is a plain answer here)."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


class _NoRedirectAsync(_AsyncConnect):
    """websockets' asyncio connector, minus following redirects."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


def _retryable(exc: BaseException) -> bool:
    """Whether a failed connection attempt may succeed if tried again before the deadline."""
    if isinstance(exc, socket.gaierror | ssl.SSLError | ssl.CertificateError):
        return False  # unknown host, TLS: the same next time
    if isinstance(exc, InvalidStatus):
        return exc.response.status_code >= 500  # a proxy or server still starting; 2xx-4xx are final
    if isinstance(exc, InvalidHandshake):
        return False  # it spoke something, but not WebSocket
    return isinstance(exc, _TRANSIENT)


def _reason(exc: BaseException | None) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return REFUSED
    if isinstance(exc, socket.gaierror):
        return UNKNOWN_HOST
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        return TLS_FAILED
    return NOT_A_POLICY_SERVER


def _metadata_from(frame: Any, limits: Limits) -> Metadata:
    """The handshake in the first frame; errors name the problem, never quote the frame."""
    if isinstance(frame, str):
        raise ProtocolError("the policy server's first frame is text; the handshake is a binary metadata frame")
    if len(frame) > MAX_METADATA_BYTES:
        raise ProtocolError(f"the policy server's handshake has {len(frame)} bytes; the cap is "
                            f"{MAX_METADATA_BYTES}")
    try:
        message = unpackb(frame, limits)
    except ProtocolError:
        raise ProtocolError("the policy server's first frame is not a msgpack metadata frame") from None
    return Metadata.from_wire(message)


def _too_big(exc: BaseException) -> bool:
    """A connection we closed because the server's first frame was over ``MAX_METADATA_BYTES``."""
    return isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == 1009


class CheckpointMismatch(ProtocolError):
    """The server's handshake names another checkpoint than the client was told to expect.

    Raised at every (re)connection of a client made with ``expected_checkpoint``: a server
    swapped behind an endpoint is never taken for the one registered there. Not retried.
    """

    def __init__(self, url: str, expected: str, served: str) -> None:
        super().__init__(f"the policy server at {url} serves checkpoint {served}, but the policy was registered "
                         f"with checkpoint {expected}; restart the registered checkpoint there, or register "
                         "this one as a new policy version (`evalforge policy register`)")
        self.expected = expected
        self.served = served


def _check_checkpoint(url: str, expected: str | None, checkpoint_sha256: str | None, revision: str | None) -> None:
    """Raise ``CheckpointMismatch`` unless the greeting names ``expected`` (as its sha256 or its revision).

    A greeting that names no checkpoint at all (an openpi or vla-eval server may not) is taken as it is.
    """
    if expected is None or (checkpoint_sha256 is None and revision is None):
        return
    if expected not in (checkpoint_sha256, revision):
        raise CheckpointMismatch(url, expected, checkpoint_sha256 or revision or "")


class PolicyTimeout(TimeoutError):
    """A call got no reply within its timeout."""


class PolicyError(RuntimeError):
    """The policy server answered a call with an ``error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


MAX_SERVER_ERROR_CHARS = 200
"""What a remote server's failure text is cut to: it reaches the API, a traceback never does."""


def server_error(text: object) -> PolicyError:
    """``PolicyError("server_error", ...)`` for a remote server's failure text (openpi's traceback frame,
    vla-eval's error payload): one line, at most ``MAX_SERVER_ERROR_CHARS`` characters. Of a Python
    traceback that is its last line, the exception (its first line is always "Traceback (most recent
    call last):", which says nothing); of anything else, its first line."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        line = "the server failed and said nothing"
    elif lines[0].startswith("Traceback (most recent call last)"):
        line = lines[-1]
    else:
        line = lines[0]
    line = "".join(ch if ch.isprintable() else "?" for ch in line)
    if len(line) > MAX_SERVER_ERROR_CHARS:
        line = line[:MAX_SERVER_ERROR_CHARS - 1] + "…"
    return PolicyError("server_error", line)


def checked_actions(actions: object, action_dim: int | None) -> np.ndarray:
    """A remote server's ``actions`` as float32 ``[chunk, action_dim]`` (``[A]`` is a chunk of one), or
    ``PolicyError("invalid_actions", ...)`` naming what came and what was expected: numbers only,
    1-D or 2-D, at least one row, finite, ``action_dim`` wide when it is known."""
    want = f"[chunk, {action_dim}]" if action_dim is not None else "[chunk, action_dim]"
    if isinstance(actions, list):
        try:
            actions = np.asarray(actions)
        except ValueError:
            raise PolicyError("invalid_actions", f"the server's actions are a ragged list; expected numbers "
                                                 f"of shape {want}") from None
    if not isinstance(actions, np.ndarray):
        raise PolicyError("invalid_actions", f"the server's actions are a {type(actions).__name__}; expected an "
                                             f"array of shape {want} (or [action_dim] for one action)")
    shape = list(actions.shape)
    if actions.dtype.kind not in "iuf":
        raise PolicyError("invalid_actions", f"the server's actions have dtype {actions.dtype}; expected numbers "
                                             f"of shape {want}")
    if actions.ndim not in (1, 2) or 0 in actions.shape:
        raise PolicyError("invalid_actions", f"the server's actions have shape {shape}; expected {want} "
                                             "(or [action_dim] for one action)")
    if action_dim is not None and actions.shape[-1] != action_dim:
        raise PolicyError("invalid_actions", f"the server's actions have shape {shape}; expected {want}: this "
                                             f"policy's actions have {action_dim} values")
    with np.errstate(over="ignore", invalid="ignore"):  # (what does not fit float32 is refused just below)
        chunk = np.ascontiguousarray(actions.reshape(1, -1) if actions.ndim == 1 else actions, dtype=np.float32)
    if not np.isfinite(chunk).all():
        raise PolicyError("invalid_actions", f"the server's actions (shape {shape}) hold NaN or infinity "
                                             "(as float32)")
    return chunk


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """Timeouts and retry schedule shared by all clients."""

    connect_deadline_s: float = 30.0  # overall budget for (re)connecting, retries included
    call_timeout_s: float = 30.0  # per call, from send to reply
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    limits: Limits = DEFAULT_LIMITS


def backoff_delays(initial: float, maximum: float, rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff with full jitter: uniform(0, min(maximum, initial * 2**n)) before retry n.

    The one back-off of the project: the clients' reconnects and the workers' episode retries.
    """
    rng = rng or random.Random()
    for attempt in itertools.count():
        yield rng.uniform(0.0, min(maximum, initial * (2**attempt)))


def _as_observation(obs: Observation | dict[str, Any]) -> Observation:
    if isinstance(obs, Observation):
        return obs
    return Observation(state=np.asarray(obs["state"], dtype=np.float32), task=obs["task"],
                       images=obs.get("images") or {})


def _unavailable(url: str, deadline: float, exc: BaseException | None, server_kind: str = "a policy server",
                 start_hint: str = "check that `policy-server` is running there and reachable"
                 ) -> PolicyUnavailable:
    reason = _reason(exc)
    said = f"nothing answered as {server_kind} within {deadline:g} s" if reason == NOT_A_POLICY_SERVER else reason
    return PolicyUnavailable(f"no policy server answered at {url}: {said}; {start_hint}", reason)


def _check_reply(reply_msg: Any, request_id: int) -> Reply | None:
    """The reply to ``request_id``; None for a late reply to an earlier, timed-out call."""
    reply = parse_reply(reply_msg)
    if isinstance(reply, ErrorReply) and reply.request_id in (request_id, None):
        raise PolicyError(reply.code, reply.message)
    return reply if reply.request_id == request_id else None


class WebSocketAdapter(PolicyAdapter):
    """The connection machinery of every synchronous client, whatever the protocol.

    ``connect`` dials directly with backoff until ``ClientSettings.connect_deadline_s`` and lets the
    subclass's ``_greet`` read the server's greeting (capped at ``MAX_METADATA_BYTES``; frames after
    it may use the full ``Limits.max_frame_bytes``). A greeting that never comes before the deadline
    is retried like a refused connection and ends ``PolicyUnavailable`` saying nothing answered as
    ``server_kind``. ``_call`` runs one exchange, reconnecting once after a dropped
    connection and running the exchange again on the new one (so the request is resent, never its
    old reply reused); a second drop raises the connection error itself.
    """

    server_kind: ClassVar[str] = "a policy server"
    start_hint: ClassVar[str] = "check that `policy-server` is running there and reachable"

    def __init__(self, url: str, settings: ClientSettings | None = None) -> None:
        self.url = url
        self.settings = settings or ClientSettings()
        self._ws: SyncConnection | None = None
        self._info: ServerInfo | None = None

    def __enter__(self) -> WebSocketAdapter:
        self.connect()
        return self

    @property
    def info(self) -> ServerInfo:
        if self._info is None:
            self.connect()
        assert self._info is not None
        return self._info

    @abstractmethod
    def _greet(self, ws: SyncConnection, deadline: float) -> ServerInfo:
        """Read (and for vla-eval, first ask for) the server's greeting on a new connection before the
        ``time.monotonic()`` ``deadline``. A transient error (``TimeoutError``, a closed connection)
        is retried until the connect deadline; anything else (``ProtocolError``) is final."""

    def connect(self) -> ServerInfo:
        """Connect (retrying until the deadline) and read the server's greeting."""
        self.close()
        s = self.settings
        deadline = time.monotonic() + s.connect_deadline_s
        last: BaseException | None = None
        for delay in backoff_delays(s.initial_backoff_s, s.max_backoff_s):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                # The greeting is capped at MAX_METADATA_BYTES; replies may use the full limit.
                ws = _NoRedirectSync(self.url, open_timeout=remaining, max_size=MAX_METADATA_BYTES,
                                     compression=None, close_timeout=1, proxy=None).connect()
            except InvalidURI as exc:
                raise ValueError(f"policy endpoint {self.url!r} is not a ws:// or wss:// URL") from exc
            except _TRANSIENT as exc:
                last = exc
                if not _retryable(exc):
                    break
            else:
                ws.pending_legacy_warning = False
                try:
                    info = self._greet(ws, deadline)
                    ws.protocol.max_message_size = s.limits.max_frame_bytes
                except _TRANSIENT as exc:
                    ws.close()
                    if _too_big(exc):
                        raise ProtocolError(f"the policy server's handshake is over the {MAX_METADATA_BYTES}-"
                                            "byte cap") from None
                    last = exc
                except BaseException:
                    ws.close()
                    raise
                else:
                    self._ws, self._info = ws, info
                    return info
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        raise _unavailable(self.url, s.connect_deadline_s, last, self.server_kind, self.start_hint)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def _call(self, exchange: Callable[[SyncConnection], T]) -> T:
        for attempt in (1, 2):
            if self._ws is None:
                self.connect()
            assert self._ws is not None
            try:
                return exchange(self._ws)
            except PolicyTimeout:
                raise  # (a TimeoutError is an OSError: without this, a timed-out call would be sent again)
            except (ConnectionClosed, OSError, EOFError):
                self.close()
                if attempt == 2:
                    raise
                log.info("connection to %s dropped; reconnecting", self.url)
        raise AssertionError("unreachable")

    def _recv(self, ws: SyncConnection, deadline: float) -> str | bytes:
        """The next frame before the ``time.monotonic()`` deadline of a call, or ``PolicyTimeout``."""
        try:
            return ws.recv(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise PolicyTimeout(f"no reply from {self.url} within {self.settings.call_timeout_s:g}s") from None


class PolicyClient(WebSocketAdapter):
    """Blocking client of an EvalForge ``policy-server``; one call at a time. Use
    ``AsyncPolicyClient`` for concurrency.

    With ``expected_checkpoint`` (a sha256 or a revision), every connection checks that the
    server's handshake names it, or raises ``CheckpointMismatch``.
    """

    protocol = "evalforge"

    def __init__(self, url: str, settings: ClientSettings | None = None, *,
                 expected_checkpoint: str | None = None) -> None:
        super().__init__(url, settings)
        self.expected_checkpoint = expected_checkpoint
        self._metadata: Metadata | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> PolicyClient:
        self.connect()
        return self

    @property
    def metadata(self) -> Metadata:
        """The server's whole handshake (``info`` holds the fields every protocol has)."""
        if self._metadata is None:
            self.connect()
        assert self._metadata is not None
        return self._metadata

    def _greet(self, ws: SyncConnection, deadline: float) -> ServerInfo:
        metadata = _metadata_from(ws.recv(timeout=max(deadline - time.monotonic(), 0.0)), self.settings.limits)
        _check_checkpoint(self.url, self.expected_checkpoint, metadata.checkpoint_sha256, metadata.revision)
        self._metadata = metadata
        return ServerInfo.from_metadata(metadata)

    def _exchange(self, ws: SyncConnection, wire: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.settings.call_timeout_s
        ws.send(packb(wire))
        while True:
            frame = self._recv(ws, deadline)
            if isinstance(frame, str):
                raise ProtocolError("policy server sent a text frame; the protocol uses binary frames")
            result = _check_reply(unpackb(frame, self.settings.limits), wire["request_id"])
            if result is not None:
                return result

    def _request(self, wire: dict[str, Any]) -> Any:
        return self._call(lambda ws: self._exchange(ws, wire))

    def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None, step: int = 0,
              stepwise: bool = False, temperature: float = 0.0, seed: int | None = None) -> ActionsReply:
        """Ask for the action chunk for ``obs`` (greedy unless ``temperature`` > 0)."""
        request = InferRequest(request_id=next(self._ids), obs=_as_observation(obs), episode_id=episode_id,
                               step=step, stepwise=stepwise, temperature=temperature, seed=seed)
        return self._request(request.to_wire())

    def reset(self, episode_id: str | None = None) -> None:
        """Clear the server's per-episode state (its action-chunk cache)."""
        self._request(ResetRequest(request_id=next(self._ids), episode_id=episode_id).to_wire())

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._request(PingRequest(request_id=next(self._ids)).to_wire())
        return time.perf_counter() - start


class AsyncPolicyClient:
    """asyncio client; any number of calls may be in flight on its one connection.

    ``expected_checkpoint``: as for ``PolicyClient``.
    """

    def __init__(self, url: str, settings: ClientSettings | None = None, *,
                 expected_checkpoint: str | None = None) -> None:
        self.url = url
        self.settings = settings or ClientSettings()
        self.expected_checkpoint = expected_checkpoint
        self._ws: AsyncConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._metadata: Metadata | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock | None = None

    async def __aenter__(self) -> AsyncPolicyClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def metadata(self) -> Metadata:
        if self._metadata is None:
            raise RuntimeError("call `await client.connect()` before reading metadata")
        return self._metadata

    async def connect(self) -> Metadata:
        """Connect (retrying until the deadline) and read the metadata frame."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._ws is not None and self._metadata is not None:
                return self._metadata
            return await self._connect_locked()

    async def _connect_locked(self) -> Metadata:
        s = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.connect_deadline_s
        last: BaseException | None = None
        for delay in backoff_delays(s.initial_backoff_s, s.max_backoff_s):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    ws = await _NoRedirectAsync(self.url, max_size=MAX_METADATA_BYTES, compression=None,
                                                open_timeout=None, close_timeout=1, proxy=None)
            except InvalidURI as exc:
                raise ValueError(f"policy endpoint {self.url!r} is not a ws:// or wss:// URL") from exc
            except _TRANSIENT as exc:
                last = exc
                if not _retryable(exc):
                    break
            else:
                try:
                    async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                        frame = await ws.recv()
                    metadata = _metadata_from(frame, s.limits)
                    _check_checkpoint(self.url, self.expected_checkpoint, metadata.checkpoint_sha256,
                                      metadata.revision)
                    self._metadata = metadata
                    ws.protocol.max_message_size = s.limits.max_frame_bytes
                except _TRANSIENT as exc:
                    await ws.close()
                    if _too_big(exc):
                        raise ProtocolError(f"the policy server's handshake is over the {MAX_METADATA_BYTES}-"
                                            "byte cap") from None
                    last = exc
                except BaseException:
                    await ws.close()
                    raise
                else:
                    self._ws = ws
                    self._reader = asyncio.create_task(self._read_replies(ws))
                    return self._metadata
            if loop.time() + delay >= deadline:
                break
            await asyncio.sleep(delay)
        raise _unavailable(self.url, s.connect_deadline_s, last)

    async def _read_replies(self, ws: AsyncConnection) -> None:
        error: BaseException = ConnectionError("connection closed")
        try:
            async for frame in ws:
                if isinstance(frame, str):
                    raise ProtocolError("policy server sent a text frame; the protocol uses binary frames")
                reply = parse_reply(unpackb(frame, self.settings.limits))
                future = self._pending.pop(reply.request_id, None) if reply.request_id is not None else None
                if future is not None and not future.done():
                    future.set_result(reply)
                elif isinstance(reply, ErrorReply) and reply.request_id is None:
                    log.warning("policy server error not tied to a request: %s: %s", reply.code, reply.message)
        except ProtocolError as exc:
            error = exc
            await ws.close()
        except ConnectionClosed as exc:
            error = exc
        finally:
            if self._ws is ws:
                self._ws = None
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(error)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None

    async def _call(self, wire: dict[str, Any]) -> Any:
        timeout = self.settings.call_timeout_s
        for attempt in (1, 2):
            if self._ws is None:
                await self.connect()
            ws = self._ws
            assert ws is not None
            request_id = wire["request_id"]
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._pending[request_id] = future
            try:
                await ws.send(packb(wire))
                async with asyncio.timeout(timeout):
                    reply = await future
            except TimeoutError:
                raise PolicyTimeout(f"no reply from {self.url} within {timeout:g}s") from None
            except (ConnectionClosed, ConnectionError, OSError):
                if attempt == 2:
                    raise
                log.info("connection to %s dropped; reconnecting", self.url)
                continue
            finally:
                self._pending.pop(request_id, None)
            if isinstance(reply, ErrorReply):
                raise PolicyError(reply.code, reply.message)
            return reply
        raise AssertionError("unreachable")

    async def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None, step: int = 0,
                    stepwise: bool = False, temperature: float = 0.0, seed: int | None = None) -> ActionsReply:
        """Ask for the action chunk for ``obs`` (greedy unless ``temperature`` > 0)."""
        request = InferRequest(request_id=next(self._ids), obs=_as_observation(obs), episode_id=episode_id,
                               step=step, stepwise=stepwise, temperature=temperature, seed=seed)
        return await self._call(request.to_wire())

    async def reset(self, episode_id: str | None = None) -> None:
        """Clear the server's per-episode state (its action-chunk cache)."""
        await self._call(ResetRequest(request_id=next(self._ids), episode_id=episode_id).to_wire())

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        await self._call(PingRequest(request_id=next(self._ids)).to_wire())
        return time.perf_counter() - start


class _ChunkCursor:
    """The unexecuted rows of the current action chunk."""

    def __init__(self, actions_per_chunk: int | None) -> None:
        self.actions_per_chunk = actions_per_chunk
        self.chunk: np.ndarray | None = None
        self.index = 0
        self.step = 0
        self.inferences = 0

    @property
    def exhausted(self) -> bool:
        """No unexecuted row is left: the next action needs an inference."""
        if self.chunk is None:
            return True
        limit = len(self.chunk) if self.actions_per_chunk is None else min(self.actions_per_chunk, len(self.chunk))
        return self.index >= limit

    def next_row(self) -> np.ndarray | None:
        if self.exhausted:
            return None
        assert self.chunk is not None
        row = self.chunk[self.index]
        self.index += 1
        self.step += 1
        return row

    def load(self, actions: np.ndarray) -> np.ndarray:
        if actions.ndim != 2 or len(actions) == 0:
            raise ProtocolError(f"expected an action chunk of shape [chunk, action_dim], got {list(actions.shape)}")
        self.chunk, self.index = actions, 0
        self.inferences += 1
        row = self.next_row()
        assert row is not None
        return row

    def clear(self) -> None:
        self.chunk, self.index, self.step = None, 0, 0


def latency_summary_ms(latencies_s: list[float]) -> tuple[float | None, float | None]:
    """Mean and p95 (linear interpolation) in ms of a broker's ``latencies_s``; (None, None) without any."""
    if not latencies_s:
        return None, None
    latencies = np.asarray(latencies_s) * 1e3
    return float(latencies.mean()), float(np.percentile(latencies, 95))


class ActionChunkBroker:
    """Executes action chunks step by step, inferring only when the chunk is used up.

    ``actions_per_chunk`` executes only the first N rows of each chunk before
    asking again (receding horizon); by default the whole chunk is executed.
    """

    def __init__(self, client: PolicyClient, *, episode_id: str | None = None,
                 actions_per_chunk: int | None = None) -> None:
        self.client = client
        self.episode_id = episode_id
        self._cursor = _ChunkCursor(actions_per_chunk)
        self.latencies_s: list[float] = []

    @property
    def inferences(self) -> int:
        return self._cursor.inferences

    @property
    def needs_observation(self) -> bool:
        """The next ``act`` asks the server (so its observation needs camera frames); otherwise the
        action comes from the current chunk and the observation is not looked at."""
        return self._cursor.exhausted

    def act(self, obs: Observation | dict[str, Any]) -> np.ndarray:
        """The action to execute now for ``obs``."""
        row = self._cursor.next_row()
        if row is not None:
            return row
        start = time.perf_counter()
        reply = self.client.infer(obs, episode_id=self.episode_id, step=self._cursor.step)
        self.latencies_s.append(time.perf_counter() - start)
        return self._cursor.load(reply.actions)

    def reset(self, episode_id: str | None = None) -> None:
        self._cursor.clear()
        self.episode_id = episode_id


class AsyncActionChunkBroker:
    """asyncio twin of ``ActionChunkBroker``."""

    def __init__(self, client: AsyncPolicyClient, *, episode_id: str | None = None,
                 actions_per_chunk: int | None = None) -> None:
        self.client = client
        self.episode_id = episode_id
        self._cursor = _ChunkCursor(actions_per_chunk)
        self.latencies_s: list[float] = []

    @property
    def inferences(self) -> int:
        return self._cursor.inferences

    @property
    def needs_observation(self) -> bool:
        """The next ``act`` asks the server (so its observation needs camera frames); otherwise the
        action comes from the current chunk and the observation is not looked at."""
        return self._cursor.exhausted

    async def act(self, obs: Observation | dict[str, Any]) -> np.ndarray:
        """The action to execute now for ``obs``."""
        row = self._cursor.next_row()
        if row is not None:
            return row
        start = time.perf_counter()
        reply = await self.client.infer(obs, episode_id=self.episode_id, step=self._cursor.step)
        self.latencies_s.append(time.perf_counter() - start)
        return self._cursor.load(reply.actions)

    def reset(self, episode_id: str | None = None) -> None:
        self._cursor.clear()
        self.episode_id = episode_id
