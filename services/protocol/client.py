"""Policy clients: synchronous (``PolicyClient``) and asyncio (``AsyncPolicyClient``).

Both connect directly (never through an HTTP proxy) with exponential backoff and
full jitter until an overall deadline, read and check the server's metadata
frame, time out each call, reconnect once after a dropped connection and retry
the call, and raise typed errors:

- ``PolicyUnavailable``: no server answered before the connect deadline;
- ``PolicyTimeout``: a call got no reply within its timeout;
- ``PolicyError``: the server answered with an ``error`` reply (``.code`` says why);
- ``ProtocolError``: a frame or message broke the protocol (including a protocol
  version mismatch, which is never retried).

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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection as SyncConnection
from websockets.sync.client import connect as sync_connect

from services.protocol.codec import DEFAULT_LIMITS, Limits, ProtocolError, packb, unpackb
from services.protocol.messages import (
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
    "ClientSettings",
    "PolicyClient",
    "PolicyError",
    "PolicyTimeout",
    "PolicyUnavailable",
    "ProtocolError",
    "backoff_delays",
]

log = logging.getLogger(__name__)

_TRANSIENT = (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, EOFError)


class PolicyUnavailable(ConnectionError):
    """No policy server could be reached before the connect deadline."""


class PolicyTimeout(TimeoutError):
    """A call got no reply within its timeout."""


class PolicyError(RuntimeError):
    """The policy server answered a call with an ``error`` reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """Timeouts and retry schedule shared by both clients."""

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


def _unavailable(url: str, deadline: float, exc: BaseException | None) -> PolicyUnavailable:
    return PolicyUnavailable(
        f"no policy server answered at {url} within {deadline:g}s (last error: {exc!r}); "
        "check that `policy-server` is running there and reachable"
    )


def _check_reply(reply_msg: Any, request_id: int) -> Reply | None:
    """The reply to ``request_id``; None for a late reply to an earlier, timed-out call."""
    reply = parse_reply(reply_msg)
    if isinstance(reply, ErrorReply) and reply.request_id in (request_id, None):
        raise PolicyError(reply.code, reply.message)
    return reply if reply.request_id == request_id else None


class PolicyClient:
    """Blocking client; one call at a time. Use ``AsyncPolicyClient`` for concurrency."""

    def __init__(self, url: str, settings: ClientSettings | None = None) -> None:
        self.url = url
        self.settings = settings or ClientSettings()
        self._ws: SyncConnection | None = None
        self._metadata: Metadata | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> PolicyClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def metadata(self) -> Metadata:
        if self._metadata is None:
            self.connect()
        assert self._metadata is not None
        return self._metadata

    def connect(self) -> Metadata:
        """Connect (retrying until the deadline) and read the metadata frame."""
        s = self.settings
        deadline = time.monotonic() + s.connect_deadline_s
        last: BaseException | None = None
        for delay in backoff_delays(s.initial_backoff_s, s.max_backoff_s):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                ws = sync_connect(self.url, open_timeout=remaining, max_size=s.limits.max_frame_bytes,
                                  compression=None, close_timeout=1, proxy=None, legacy=True)
            except InvalidURI as exc:
                raise ValueError(f"policy endpoint {self.url!r} is not a ws:// or wss:// URL") from exc
            except _TRANSIENT as exc:
                last = exc
            else:
                try:
                    self._metadata = Metadata.from_wire(unpackb(ws.recv(timeout=remaining), s.limits))
                except _TRANSIENT as exc:
                    ws.close()
                    last = exc
                except BaseException:
                    ws.close()
                    raise
                else:
                    self._ws = ws
                    return self._metadata
            if time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        raise _unavailable(self.url, s.connect_deadline_s, last)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def _call(self, wire: dict[str, Any]) -> Any:
        for attempt in (1, 2):
            if self._ws is None:
                self.connect()
            assert self._ws is not None
            try:
                return self._exchange(self._ws, wire)
            except (ConnectionClosed, OSError, EOFError):
                self.close()
                if attempt == 2:
                    raise
                log.info("connection to %s dropped; reconnecting", self.url)
        raise AssertionError("unreachable")

    def _exchange(self, ws: SyncConnection, wire: dict[str, Any]) -> Any:
        timeout = self.settings.call_timeout_s
        deadline = time.monotonic() + timeout
        ws.send(packb(wire))
        while True:
            remaining = deadline - time.monotonic()
            try:
                frame = ws.recv(timeout=max(remaining, 0.0))
            except TimeoutError:
                raise PolicyTimeout(f"no reply from {self.url} within {timeout:g}s") from None
            if isinstance(frame, str):
                raise ProtocolError("policy server sent a text frame; the protocol uses binary frames")
            result = _check_reply(unpackb(frame, self.settings.limits), wire["request_id"])
            if result is not None:
                return result

    def infer(self, obs: Observation | dict[str, Any], *, episode_id: str | None = None, step: int = 0,
              stepwise: bool = False, temperature: float = 0.0, seed: int | None = None) -> ActionsReply:
        """Ask for the action chunk for ``obs`` (greedy unless ``temperature`` > 0)."""
        request = InferRequest(request_id=next(self._ids), obs=_as_observation(obs), episode_id=episode_id,
                               step=step, stepwise=stepwise, temperature=temperature, seed=seed)
        return self._call(request.to_wire())

    def reset(self, episode_id: str | None = None) -> None:
        """Clear the server's per-episode state (its action-chunk cache)."""
        self._call(ResetRequest(request_id=next(self._ids), episode_id=episode_id).to_wire())

    def ping(self) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._call(PingRequest(request_id=next(self._ids)).to_wire())
        return time.perf_counter() - start


class AsyncPolicyClient:
    """asyncio client; any number of calls may be in flight on its one connection."""

    def __init__(self, url: str, settings: ClientSettings | None = None) -> None:
        self.url = url
        self.settings = settings or ClientSettings()
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
                    ws = await async_connect(self.url, max_size=s.limits.max_frame_bytes, compression=None,
                                             open_timeout=None, close_timeout=1, proxy=None)
            except InvalidURI as exc:
                raise ValueError(f"policy endpoint {self.url!r} is not a ws:// or wss:// URL") from exc
            except _TRANSIENT as exc:
                last = exc
            else:
                try:
                    async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                        frame = await ws.recv()
                    self._metadata = Metadata.from_wire(unpackb(frame, s.limits))
                except _TRANSIENT as exc:
                    await ws.close()
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

    def next_row(self) -> np.ndarray | None:
        if self.chunk is None:
            return None
        limit = len(self.chunk) if self.actions_per_chunk is None else min(self.actions_per_chunk, len(self.chunk))
        if self.index >= limit:
            return None
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
