"""A small protocol-speaking server for testing the clients, with fault switches.

It answers ``infer`` with a deterministic function of the observation (so every
caller can check it got *its own* answer) and can be told to stall, drop the
connection, send a text frame, announce another protocol version or checkpoint, or
send any handshake it is given.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.server import ServerConnection, serve

from services.protocol.codec import packb, unpackb
from services.protocol.messages import (
    ActionsReply,
    BareObservationRequest,
    ErrorCode,
    ErrorReply,
    InferRequest,
    Metadata,
    PongReply,
    parse_request,
)

STATE_DIM, ACTION_DIM, CHUNK = 6, 3, 4
TASKS = ("reach-v3", "push-v3")


def expected_actions(state: np.ndarray) -> np.ndarray:
    """What this server answers for ``state``: a chunk whose row i is state[:A] + i."""
    return (state[:ACTION_DIM][None, :] + np.arange(CHUNK, dtype=np.float32)[:, None]).astype(np.float32)


@dataclass
class Faults:
    delay_s: float = 0.0
    drop_next: int = 0  # close the connection instead of answering the next N requests
    text_frame_next: bool = False
    protocol_version: int = 1
    checkpoint_sha256: str = "0" * 64  # what the handshake names (swap it to play a swapped server)
    metadata_wire: dict | None = None  # send this as the handshake instead (oversized, malformed…)


@dataclass
class LoopbackPolicyServer:
    port: int = 0
    faults: Faults = field(default_factory=Faults)
    connections: int = 0
    requests: int = 0

    def start(self) -> LoopbackPolicyServer:
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(ready)), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("loopback server did not start")
        return self

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serve(self._handle, "127.0.0.1", self.port, compression=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await self._stop.wait()

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        meta = Metadata(policy_name="loopback", checkpoint_sha256=self.faults.checkpoint_sha256,
                        state_dim=STATE_DIM, action_dim=ACTION_DIM, chunk_size=CHUNK, tasks=TASKS,
                        protocol_version=self.faults.protocol_version)
        await ws.send(packb(self.faults.metadata_wire if self.faults.metadata_wire is not None
                            else meta.to_wire()))
        async for frame in ws:
            asyncio.create_task(self._answer(ws, frame))

    async def _answer(self, ws: ServerConnection, frame: bytes) -> None:
        self.requests += 1
        if self.faults.drop_next > 0:
            self.faults.drop_next -= 1
            await ws.close()
            return
        if self.faults.text_frame_next:
            self.faults.text_frame_next = False
            await ws.send("not binary")
            return
        if self.faults.delay_s:
            await asyncio.sleep(self.faults.delay_s)
        request = parse_request(unpackb(frame))
        if isinstance(request, BareObservationRequest):
            state = np.asarray(request.obs["state"], dtype=np.float32)
            await ws.send(packb({"actions": expected_actions(state), "server_timing": {"infer_ms": 0.0}}))
        elif isinstance(request, InferRequest):
            if request.obs.task not in TASKS:
                reply = ErrorReply(request.request_id, ErrorCode.UNKNOWN_TASK, f"unknown task {request.obs.task!r}")
            else:
                reply = ActionsReply(request.request_id, expected_actions(request.obs.state), {"infer_ms": 0.0})
            await ws.send(packb(reply.to_wire()))
        else:
            await ws.send(packb(PongReply(request.request_id).to_wire()))
