"""The policy server: turns observations into action chunks over WebSocket and HTTP.

``PolicyService`` does the work (validate, tokenize with the checkpoint's
``policy_format`` tokenizer — the trainer's own —, run the engine, de-tokenize,
cache chunks per episode, count everything);
``create_app`` wraps it in an ASGI app:

- ``/ws`` and ``/``: WebSocket, metadata frame first, then msgpack requests. Each
  request is handled as its own task, so one connection may have many in flight
  and every request reaches the engine as it arrives.
- ``/vla-eval``: WebSocket speaking allenai vla-eval's model-server protocol, so
  ``vla-eval run --server-url ws://HOST:PORT/vla-eval`` evaluates this policy
  (``services/policy_server/vla_eval.py``).
- ``POST /act``: one request per HTTP call, msgpack body (same frames as the
  WebSocket) or JSON for convenience.
- ``GET /healthz`` (alive), ``GET /readyz`` (model loaded and warmed up) — both echo
  ``EVALFORGE_INSTANCE_TOKEN`` as ``"instance"`` for the supervisor that started it —
  ``GET /metrics`` (Prometheus).

Bad input gets an ``error`` reply with a code and a message naming the field —
never a traceback — and the connection stays usable.

**Images.** The metadata announces the cameras the checkpoint's card declares
(``PolicyCard.camera_sizes``). For such a policy every infer request and every bare
(openpi-style) request is held to them (``Observation.check_images``): a missing
camera, a non-uint8 image or one of another shape gets ``invalid_image`` naming the
camera and the expected ``[H, W, 3]`` (HTTP 422 on ``POST /act``); JSON bodies carry no
arrays, so camera policies take msgpack. A card with cameras but no vision encoder
validates the images and ignores them; so does a state-only policy with any well-formed
images it gets.

**Vision policies** (a card with ``vision``): the images are preprocessed by
``policy_format.pixel_values`` (the trainer's code), encoded by the checkpoint's vision
tower — batched across the requests in flight, on a thread of its own
(``services/policy_server/vision.py``) — and the rows go to the engine with the prompt.
Such a policy also refuses a camera it does not know (``invalid_image`` naming it and
listing the cameras and shapes it takes), rather than ignoring it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from policy_format import PolicyCheckpoint, pixel_values
from services.policy_server.engines import Engine
from services.protocol.codec import DEFAULT_LIMITS, Limits, ProtocolError, packb, unpackb
from services.protocol.messages import (
    PROTOCOL_VERSION,
    ActionsReply,
    BareObservationRequest,
    ErrorCode,
    ErrorReply,
    InferRequest,
    InvalidImage,
    InvalidObservation,
    Metadata,
    Observation,
    PongReply,
    ProtocolVersionMismatch,
    ResetRequest,
    UnknownMessageType,
    parse_request,
)

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
HTTP_STATUS = {
    ErrorCode.OVERLOADED: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNKNOWN_TASK: 422,
    ErrorCode.INVALID_OBSERVATION: 422,
    ErrorCode.INVALID_IMAGE: 422,
}


_UNDECODED = object()


class RequestError(Exception):
    """A request this server refuses, with the code and message the client gets."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PolicyMetrics:
    """Prometheus metrics of one server, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        latency_buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
        self.requests = Counter("evalforge_policy_requests_total", "Requests received, by type.", ["type"],
                                registry=self.registry)
        self.errors = Counter("evalforge_policy_errors_total", "Error replies sent, by code.", ["code"],
                              registry=self.registry)
        self.request_seconds = Histogram("evalforge_policy_request_seconds",
                                         "End-to-end time of infer requests inside the server.",
                                         buckets=latency_buckets, registry=self.registry)
        self.engine_seconds = Histogram("evalforge_policy_engine_seconds", "Time spent in the inference engine.",
                                        buckets=latency_buckets, registry=self.registry)
        self.batch_size = Histogram("evalforge_policy_engine_batch_size",
                                    "Requests running together in each engine step.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=self.registry)
        self.connections = Gauge("evalforge_policy_open_connections", "Open WebSocket connections.",
                                 registry=self.registry)
        self.cached_actions = Counter("evalforge_policy_cached_actions_total",
                                      "Stepwise actions served from the chunk cache.", registry=self.registry)
        self.encoder_seconds = Histogram("evalforge_policy_encoder_seconds",
                                         "Time a request waited for its image rows (vision policies).",
                                         buckets=latency_buckets, registry=self.registry)
        self.encoder_batch_images = Histogram("evalforge_policy_encoder_batch_images",
                                              "Images in each vision-encoder forward (vision policies).",
                                              buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.encoder_cpu = Counter("evalforge_policy_encoder_cpu_seconds_total",
                                   "CPU time of the vision encoder's forwards (vision policies).",
                                   registry=self.registry)


class PolicyService:
    """Everything the server does, independent of the transport."""

    def __init__(self, checkpoint: PolicyCheckpoint, engine: Engine, *, name: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, chunk_cache_episodes: int = 4096) -> None:
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.engine = engine
        self.limits = limits
        self.metrics = PolicyMetrics()
        engine.on_batch = self.metrics.batch_size.observe
        self.metadata = Metadata(
            policy_name=name or checkpoint.name,
            checkpoint_sha256=checkpoint.checkpoint_sha256,
            state_dim=self.tokenizer.state_dim,
            action_dim=self.tokenizer.action_dim,
            chunk_size=self.tokenizer.chunk_size,
            tasks=tuple(self.tokenizer.tasks),
            cameras=checkpoint.card.camera_sizes,
            extra={"engine": engine.name, "suite": checkpoint.card.suite, "instructions":
                   {t: checkpoint.card.instructions.get(t, "") for t in self.tokenizer.tasks}},
        )
        self._metadata_frame = packb(self.metadata.to_wire())
        self._ready = asyncio.Event()
        self.draining = False
        self.inflight = 0
        self._chunks: OrderedDict[str, list[np.ndarray]] = OrderedDict()
        self._chunk_cache_episodes = chunk_cache_episodes
        self.vision = None  # a vision policy's BatchedVisionEncoder, loaded by start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def start(self) -> None:
        """Load the engine and warm it up; ``/readyz`` turns true after this."""
        started = time.perf_counter()
        card = self.checkpoint.card
        if card.vision is not None:
            from services.policy_server.vision import BatchedVisionEncoder, load_vision_tower

            tower = await asyncio.to_thread(load_vision_tower, self.checkpoint)
            self.vision = BatchedVisionEncoder(tower)
            self.vision.on_batch = self.metrics.encoder_batch_images.observe
            self.vision.on_cpu = self.metrics.encoder_cpu.inc
        await self.engine.start()
        task = self.tokenizer.tasks[0]
        state = ((self.tokenizer.state.low + self.tokenizer.state.high) / 2).astype(np.float32)
        image_rows = None
        if self.vision is not None:
            blank = {c.name: np.zeros((c.height, c.width, 3), np.uint8) for c in card.cameras}
            image_rows = await self.vision.encode(pixel_values(blank, card.cameras))
        await self.engine.generate(self.tokenizer.prompt(task, state), image_rows=image_rows)
        # What exists now (torch, vLLM, the model) lives until exit: freeze it out of
        # the collector's reach, or a full collection over it stalls requests for
        # hundreds of milliseconds (vLLM's own API server does the same).
        gc.collect()
        gc.freeze()
        self._ready.set()
        log.info("policy %s ready on engine %s in %.1fs", self.metadata.policy_name, self.engine.name,
                 time.perf_counter() - started)

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def metadata_frame(self) -> bytes:
        return self._metadata_frame

    def check_observation(self, obs: Observation) -> None:
        if obs.state.shape != (self.tokenizer.state_dim,):
            raise RequestError(ErrorCode.INVALID_OBSERVATION,
                               f"observation field 'state' must have shape [{self.tokenizer.state_dim}], "
                               f"got {list(obs.state.shape)}")
        if obs.task not in self.tokenizer.task_ids:
            known = ", ".join(sorted(self.tokenizer.task_ids)[:10])
            raise RequestError(ErrorCode.UNKNOWN_TASK,
                               f"observation field 'task' is {obs.task[:80]!r}, which this policy was not trained "
                               f"for; known tasks: {known}")
        if self.checkpoint.card.vision is not None:
            cameras = self.metadata.cameras
            for camera in obs.images:
                if camera not in cameras:
                    takes = ", ".join(f"{name} uint8 [{h}, {w}, 3]" for name, (h, w) in cameras.items())
                    raise RequestError(ErrorCode.INVALID_IMAGE,
                                       f"observation has an image of camera {str(camera)[:64]!r}, which this policy "
                                       f"does not take; it takes {len(cameras)} camera(s): {takes}")

    async def infer_chunk(self, obs: Observation, *, temperature: float = 0.0,
                          seed: int | None = None) -> tuple[np.ndarray, dict[str, float]]:
        """The action chunk for one observation, with the timing of the work."""
        self.check_observation(obs)
        if self.draining:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "the policy server is shutting down; retry elsewhere")
        if not self.ready:
            await self.wait_ready()
        timing: dict[str, float] = {}
        image_rows = None
        if self.vision is not None:
            start = time.perf_counter()
            image_rows = await self.vision.encode(pixel_values(obs.images, self.checkpoint.card.cameras))
            encoder_s = time.perf_counter() - start
            self.metrics.encoder_seconds.observe(encoder_s)
            timing["encoder_ms"] = encoder_s * 1e3
        start = time.perf_counter()
        tokens = await self.engine.generate(self.tokenizer.prompt(obs.task, obs.state),
                                            temperature=temperature, seed=seed,
                                            **({"image_rows": image_rows} if image_rows is not None else {}))
        engine_s = time.perf_counter() - start
        self.metrics.engine_seconds.observe(engine_s)
        return self.tokenizer.decode_actions(tokens), {"engine_ms": engine_s * 1e3, **timing}

    async def infer_observation(self, obs: Observation, kind: str) -> tuple[np.ndarray, dict[str, float]]:
        """An action chunk for a request without the protocol envelope (openpi-style, JSON)."""
        self.metrics.requests.labels(kind).inc()
        self.inflight += 1
        start = time.perf_counter()
        try:
            result = await self.infer_chunk(obs)
        finally:
            self.inflight -= 1
        self.metrics.request_seconds.observe(time.perf_counter() - start)
        return result

    async def infer(self, request: InferRequest) -> ActionsReply:
        if not request.stepwise:
            actions, timing = await self.infer_chunk(request.obs, temperature=request.temperature, seed=request.seed)
            return ActionsReply(request.request_id, actions, timing)
        if request.episode_id is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "a stepwise infer request needs an 'episode_id'")
        rows = self._chunks.get(request.episode_id)
        if rows:
            self.check_observation(request.obs)
            self.metrics.cached_actions.inc()
            return ActionsReply(request.request_id, rows.pop(0), {"engine_ms": 0.0, "cached": 1.0})
        actions, timing = await self.infer_chunk(request.obs, temperature=request.temperature, seed=request.seed)
        self._chunks[request.episode_id] = list(actions[1:])
        self._chunks.move_to_end(request.episode_id)
        while len(self._chunks) > self._chunk_cache_episodes:
            self._chunks.popitem(last=False)
        return ActionsReply(request.request_id, actions[0], timing)

    def reset(self, request: ResetRequest) -> PongReply:
        if request.episode_id is not None:
            self._chunks.pop(request.episode_id, None)
        return PongReply(request.request_id)

    async def handle(self, frame: bytes | bytearray) -> tuple[bytes, ErrorCode | None]:
        """Answer one binary frame; returns the reply frame and the error code, if any."""
        self.inflight += 1
        start = time.perf_counter()
        request_id: Any = None
        message: Any = _UNDECODED
        try:
            message = unpackb(frame, self.limits)
            if isinstance(message, dict):
                candidate = message.get("request_id")
                request_id = candidate if isinstance(candidate, int | str) and not isinstance(candidate, bool) else None
            request = parse_request(message, self.metadata.cameras)
            if isinstance(request, InferRequest):
                self.metrics.requests.labels("infer").inc()
                reply = await self.infer(request)
                self.metrics.request_seconds.observe(time.perf_counter() - start)
                return packb(reply.to_wire()), None
            if isinstance(request, BareObservationRequest):
                # counted here, not through infer_observation(): this frame is already in flight
                self.metrics.requests.labels("bare").inc()
                actions, timing = await self.infer_chunk(self._bare_observation(request.obs))
                timing["infer_ms"] = (time.perf_counter() - start) * 1e3
                self.metrics.request_seconds.observe(timing["infer_ms"] / 1e3)
                return packb({"actions": actions, "server_timing": timing}), None
            if isinstance(request, ResetRequest):
                self.metrics.requests.labels("reset").inc()
                return packb(self.reset(request).to_wire()), None
            self.metrics.requests.labels("ping").inc()
            return packb(PongReply(request.request_id).to_wire()), None
        except RequestError as exc:
            return self._error(request_id, exc.code, exc.message)
        except ProtocolVersionMismatch as exc:
            return self._error(request_id, ErrorCode.PROTOCOL_VERSION, f"{exc}; this server speaks {PROTOCOL_VERSION}")
        except UnknownMessageType as exc:
            return self._error(request_id, ErrorCode.UNKNOWN_TYPE, str(exc))
        except InvalidImage as exc:
            return self._error(request_id, ErrorCode.INVALID_IMAGE, str(exc))
        except InvalidObservation as exc:
            return self._error(request_id, ErrorCode.INVALID_OBSERVATION, str(exc))
        except ProtocolError as exc:
            code = ErrorCode.BAD_FRAME if message is _UNDECODED else ErrorCode.BAD_REQUEST
            return self._error(request_id, code, str(exc))
        except Exception:
            log.exception("internal error while answering request %r", request_id)
            return self._error(request_id, ErrorCode.INTERNAL, "internal server error; see the server's log")
        finally:
            self.inflight -= 1

    def _bare_observation(self, obs: dict[str, Any]) -> Observation:
        """openpi-style requests name the instruction 'prompt'; accept it for 'task'."""
        if "task" not in obs and isinstance(obs.get("prompt"), str):
            obs = {**obs, "task": obs["prompt"]}
        return Observation.from_wire(obs, self.metadata.cameras)

    def _error(self, request_id: Any, code: ErrorCode, message: str) -> tuple[bytes, ErrorCode]:
        self.metrics.errors.labels(str(code)).inc()
        return packb(ErrorReply(request_id, code, message).to_wire()), code

    def error_frame(self, code: ErrorCode, message: str) -> bytes:
        return self._error(None, code, message)[0]


def create_app(service: PolicyService, *, on_fatal: Callable[[BaseException], None] | None = None,
               max_http_body: int | None = None) -> Starlette:
    """The ASGI app; the engine starts in the background so /healthz answers at once."""
    from services.policy_server.vla_eval import VlaEvalEndpoint  # (that module builds on this one)

    max_body = max_http_body or service.limits.max_frame_bytes
    vla_eval = VlaEvalEndpoint(service)

    # Set by a supervisor (services/supervisor.py): echoed so its health check knows it reached its own child.
    token = os.environ.get("EVALFORGE_INSTANCE_TOKEN")
    instance = {"instance": token} if token else {}

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", **instance})

    async def readyz(request: Request) -> Response:
        if service.ready and not service.draining:
            return JSONResponse({"ready": True, "policy": service.metadata.policy_name, **instance})
        return JSONResponse({"ready": False, "draining": service.draining, **instance}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def act(request: Request) -> Response:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return JSONResponse({"error": {"code": ErrorCode.BAD_FRAME,
                                           "message": f"body of {length} bytes is over the {max_body}-byte cap"}},
                                status_code=413)
        body = await request.body()
        if len(body) > max_body:
            return JSONResponse({"error": {"code": ErrorCode.BAD_FRAME,
                                           "message": f"body is over the {max_body}-byte cap"}}, status_code=413)
        if request.headers.get("content-type", "").split(";")[0].strip() == "application/json":
            return await _act_json(body)
        reply, code = await service.handle(body)
        return Response(reply, media_type=MSGPACK, status_code=HTTP_STATUS.get(code, 400) if code else 200)

    async def _act_json(body: bytes) -> Response:
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("the body must be a JSON object")
            obs = payload.get("obs", payload)
            state = obs.get("state") if isinstance(obs, dict) else None
            if not isinstance(state, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                       for v in state):
                raise ValueError("'state' must be a list of numbers")
            observation = Observation.from_wire({**obs, "state": np.asarray(state, dtype=np.float32)},
                                                service.metadata.cameras)
            actions, timing = await service.infer_observation(observation, "json")
        except InvalidImage as exc:
            return _json_error(ErrorCode.INVALID_IMAGE, str(exc))
        except (ValueError, InvalidObservation) as exc:
            return _json_error(ErrorCode.INVALID_OBSERVATION if isinstance(exc, InvalidObservation)
                               else ErrorCode.BAD_REQUEST, str(exc))
        except RequestError as exc:
            return _json_error(exc.code, exc.message)
        return JSONResponse({"actions": actions.tolist(), "timing": timing})

    def _json_error(code: ErrorCode, message: str) -> Response:
        service.metrics.errors.labels(str(code)).inc()
        return JSONResponse({"error": {"code": str(code), "message": message}},
                            status_code=HTTP_STATUS.get(code, 400))

    async def websocket(ws: WebSocket) -> None:
        await ws.accept()
        service.metrics.connections.inc()
        send_lock = asyncio.Lock()
        tasks: set[asyncio.Task] = set()

        async def send(frame: bytes) -> None:
            async with send_lock:
                try:
                    await ws.send_bytes(frame)
                except (WebSocketDisconnect, RuntimeError):
                    pass  # the client left; its reply has nowhere to go

        async def respond(frame: bytes) -> None:
            reply, _ = await service.handle(frame)
            await send(reply)

        try:
            await service.wait_ready()
            await ws.send_bytes(service.metadata_frame())
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                frame = message.get("bytes")
                if frame is None:
                    await send(service.error_frame(
                        ErrorCode.BAD_FRAME, "text frames are not part of the protocol; send binary msgpack frames"))
                    continue
                task = asyncio.create_task(respond(frame))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except WebSocketDisconnect:
            pass
        finally:
            for task in tasks:
                task.cancel()
            service.metrics.connections.dec()

    background: set[asyncio.Task] = set()

    async def lifespan(app: Starlette):  # noqa: ANN202 - Starlette's lifespan protocol
        async def start() -> None:
            try:
                await service.start()
            except Exception as exc:
                log.exception("policy engine failed to start")
                if on_fatal is not None:
                    on_fatal(exc)

        task = asyncio.create_task(start())
        background.add(task)
        try:
            yield
        finally:
            task.cancel()
            await service.engine.close()

    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", metrics),
            Route("/act", act, methods=["POST"]),
            WebSocketRoute("/ws", websocket),
            WebSocketRoute("/vla-eval", vla_eval.serve),
            WebSocketRoute("/", websocket),
        ],
        lifespan=lifespan,
    )
