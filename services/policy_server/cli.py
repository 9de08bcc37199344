"""`policy-server`: serve a policy checkpoint over WebSocket and HTTP.

    policy-server --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--engine vllm|hf] [--name NAME]

Every flag is also a ``POLICY_SERVER_*`` environment variable (``--max-num-seqs`` ↔
``POLICY_SERVER_MAX_NUM_SEQS``, see ``services/policy_server/settings.py``); a flag
overrides the variable. The checkpoint is validated before anything starts — its card,
and its safetensors headers and shapes against config.json (``weights``) — and a bad
one is refused in one line with what is wrong in it (exit status 2). The server binds loopback unless told otherwise.
On SIGTERM or Ctrl-C it stops taking new requests (they get ``shutting_down``),
finishes those in flight, then exits; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

import uvicorn
from pydantic import ValidationError

from policy_format import CheckpointError, load_checkpoint
from services.policy_server.app import PolicyService, create_app
from services.policy_server.engines import EngineSettings, build_inference_engine
from services.policy_server.settings import PolicyServerSettings
from services.policy_server.weights import WeightsError, check_weights
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default (the environment's, if set) after its help."""


# flags whose spelling is not the settings field's with dashes
_FLAGS = {"drain_timeout_s": "--drain-timeout"}


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def build_parser(defaults: PolicyServerSettings | None = None) -> argparse.ArgumentParser:
    """The command line; a flag's default is ``defaults``' value (the environment's when not given)."""
    defaults = defaults if defaults is not None else PolicyServerSettings()
    parser = argparse.ArgumentParser(prog="policy-server", description=__doc__, formatter_class=_HelpFormatter)

    def add(field: str, group: Any = parser, **kwargs: Any) -> None:
        kwargs.setdefault("default", getattr(defaults, field))
        group.add_argument(_flag(field), dest=field, help=PolicyServerSettings.model_fields[field].description,
                           **kwargs)

    checkpoint = defaults.checkpoint
    add("checkpoint", required=checkpoint is None, default=None if checkpoint is None else str(checkpoint),
        metavar="DIR")
    add("host")
    add("port", type=int)
    add("engine", choices=["vllm", "hf", "null"])
    add("name")
    engine = parser.add_argument_group("vLLM engine")
    add("dtype", engine)
    add("max_num_seqs", engine, type=int)
    add("max_num_batched_tokens", engine, type=int)
    add("kv_cache_gib", engine, type=float)
    add("memory_utilization", engine, type=float)
    add("compile", engine, action=argparse.BooleanOptionalAction)
    add("omp_threads_bind", engine)
    add("executor", engine, choices=["uni", "mp"])
    add("engine_core", engine, choices=["vllm", "compute"])
    add("loop", choices=["asyncio", "uvloop"])
    add("max_frame_bytes", type=int)
    add("drain_timeout_s", type=float, metavar="SECONDS")
    add("log_level", choices=["debug", "info", "warning", "error"])
    return parser


def _problems(exc: ValidationError, name: Any) -> str:
    return "; ".join(f"{name(str(error['loc'][0]))}: {error['msg']}" if error["loc"] else error["msg"]
                     for error in exc.errors())


def read_settings(argv: list[str] | None = None) -> PolicyServerSettings:
    """The server's settings: flags in ``argv`` over ``POLICY_SERVER_*`` variables over the defaults."""
    try:
        environment = PolicyServerSettings()
    except ValidationError as exc:
        prefix = PolicyServerSettings.model_config["env_prefix"]
        print(f"policy-server: error: {_problems(exc, lambda f: prefix + f.upper())}", file=sys.stderr)
        raise SystemExit(2) from None
    parser = build_parser(environment)
    args = parser.parse_args(argv)
    try:
        return PolicyServerSettings(**vars(args))
    except ValidationError as exc:
        parser.error(_problems(exc, _flag))


def engine_settings(settings: PolicyServerSettings) -> EngineSettings:
    return EngineSettings(dtype=settings.dtype, max_num_seqs=settings.max_num_seqs,
                          max_num_batched_tokens=settings.max_num_batched_tokens,
                          enforce_eager=not settings.compile, kv_cache_gib=settings.kv_cache_gib,
                          memory_utilization=settings.memory_utilization,
                          omp_threads_bind=settings.omp_threads_bind, executor=settings.executor,
                          engine_core_on_compute_cores=settings.engine_core == "compute")


def main(argv: list[str] | None = None) -> int:
    settings = read_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        checkpoint = load_checkpoint(settings.checkpoint)
        check_weights(checkpoint.directory)
    except (CheckpointError, WeightsError) as exc:
        print(f"policy-server: error: {exc}", file=sys.stderr)
        return 2
    limits = Limits(max_frame_bytes=settings.max_frame_bytes)
    engine = build_inference_engine(settings.engine, checkpoint, engine_settings(settings))
    service = PolicyService(checkpoint, engine, name=settings.name, limits=limits)
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        if server is not None:
            server.fail(exc)

    app = create_app(service, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, ws="websockets-sansio",
                            ws_max_size=2 * limits.max_frame_bytes, ws_per_message_deflate=False,
                            log_level=settings.log_level, timeout_graceful_shutdown=5, lifespan="on",
                            loop=settings.loop)
    server = DrainingServer(config, service, settings.drain_timeout_s)
    log.info("serving %s (%s engine) on http://%s:%d, WebSocket at /ws", checkpoint.name, settings.engine,
             settings.host, settings.port)
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
