"""`policy-server`: serve a policy checkpoint over WebSocket and HTTP.

    policy-server --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--engine vllm|hf] [--name NAME]

The checkpoint is validated before anything starts; a bad one is refused with
what is wrong in it. The server binds loopback unless told otherwise. On SIGTERM
or Ctrl-C it stops taking new requests (they get ``shutting_down``), finishes
those in flight, then exits; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from types import FrameType

import uvicorn

from services.policy_server.app import PolicyService, create_app
from services.policy_server.engines import EngineSettings, make_engine
from services.policy_server.policy_format import CheckpointError, load_policy_spec
from services.protocol.codec import Limits

log = logging.getLogger("policy_server")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains in-flight requests."""

    def __init__(self, config: uvicorn.Config, service: PolicyService, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.service.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.service.draining = True
        log.info("signal %s: draining %d in-flight request(s)", signal.Signals(sig).name, self.service.inflight)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain_then_exit(sig)))

    async def _drain_then_exit(self, sig: int) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.service.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.service.inflight:
            log.warning("drain timed out with %d request(s) still in flight", self.service.inflight)
        # Not handle_exit(): uvicorn would re-raise the signal at the end, and a
        # drained shutdown is a clean one (exit status 0).
        self.should_exit = True

    def fail(self, exc: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policy-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="policy checkpoint directory (HF weights + policy.json)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                        help="vllm: continuous batching (default); hf: transformers, one request at a time")
    parser.add_argument("--name", help="policy name announced in the handshake (default: policy.json's name)")
    engine = parser.add_argument_group("vLLM engine")
    defaults = EngineSettings()
    engine.add_argument("--dtype", default=defaults.dtype, help="weights and activations dtype (default: float32)")
    engine.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="most requests batched in one engine step")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib,
                        help="KV-cache space on CPU hosts, GiB")
    engine.add_argument("--memory-utilization", type=float, default=defaults.memory_utilization,
                        help="fraction of device (or, on CPU, host) memory vLLM may claim")
    engine.add_argument("--compile", action="store_true", help="let vLLM torch.compile the model (slower start)")
    engine.add_argument("--omp-threads-bind", default=None,
                        help="CPU cores for vLLM's OpenMP threads, e.g. '0-1' or 'nobind' (default: vLLM's auto)")
    engine.add_argument("--executor", choices=["uni", "mp"], default=None,
                        help="uni: run the model inside the engine-core process (one process fewer); "
                             "mp: a worker process per device (vLLM's default)")
    engine.add_argument("--engine-core", choices=["vllm", "compute"], default="vllm",
                        help="CPU hosts: where vLLM's engine-core (scheduler) process runs. vllm (default): where "
                             "vLLM leaves it, the fastest on a host that serves; its busy-wait takes a core's idle "
                             "time. compute: on its worker's cores, so the other cores stay free for simulators "
                             "or clients on this host (evalforge up and trainer rollout use it; "
                             "docs/benchmarks.md)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="event loop (default asyncio: vLLM's front end kept less of the raw engine's "
                             "throughput on uvloop; docs/benchmarks.md)")
    parser.add_argument("--max-frame-bytes", type=int, default=Limits().max_frame_bytes,
                        help="largest request frame accepted (default 64 MiB)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to wait for in-flight requests on shutdown")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=not args.compile,
                          kv_cache_gib=args.kv_cache_gib, memory_utilization=args.memory_utilization,
                          omp_threads_bind=args.omp_threads_bind, executor=args.executor,
                          engine_core_on_compute_cores=args.engine_core == "compute")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = load_policy_spec(args.checkpoint)
    except CheckpointError as exc:
        print(f"policy-server: error: {exc}", file=sys.stderr)
        return 2
    settings = engine_settings(args)
    limits = Limits(max_frame_bytes=args.max_frame_bytes)
    service = PolicyService(spec, make_engine(args.engine, spec, settings), name=args.name, limits=limits)
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        if server is not None:
            server.fail(exc)

    app = create_app(service, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=args.host, port=args.port, ws="websockets-sansio",
                            ws_max_size=2 * limits.max_frame_bytes, ws_per_message_deflate=False,
                            log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on", loop=args.loop)
    server = DrainingServer(config, service, args.drain_timeout)
    log.info("serving %s (%s engine) on http://%s:%d, WebSocket at /ws", spec.name, args.engine, args.host, args.port)
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
