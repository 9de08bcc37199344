"""Fixtures for policy-server tests: checkpoints made by `trainer init-policy`, and
real `policy-server` processes on free ports (the vLLM one starts once per session)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from trainer.cli import main as trainer_main

STATE_DIM, ACTION_DIM, CHUNK = 39, 4, 4
TASKS = ("reach-v3", "push-v3", "pick-place-v3")


def make_checkpoint(out: Path, **overrides: object) -> Path:
    args = ["init-policy", "--out", str(out), "--state-dim", str(STATE_DIM), "--action-dim", str(ACTION_DIM),
            "--tasks", ",".join(TASKS), "--chunk-size", str(CHUNK), "--init-std", "0.1", "--force"]
    for key, value in overrides.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    trainer_main(args)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    ready_when_first_healthy: bool | None = None

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(checkpoint: Path, log_dir: Path, *args: str, timeout: float = 240) -> ServerProcess:
    """Start `policy-server` and wait until /readyz says ready."""
    port = free_port()
    log_path = log_dir / f"policy-server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.policy_server", "--checkpoint", str(checkpoint), "--port", str(port), *args],
        stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"policy-server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.http_url}/healthz", timeout=1).status_code == 200:
                ready = httpx.get(f"{server.http_url}/readyz", timeout=1).status_code == 200
                if server.ready_when_first_healthy is None:
                    server.ready_when_first_healthy = ready
                if ready:
                    return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"policy-server did not become ready in {timeout}s:\n{server.log()}")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy-1m")


@pytest.fixture(scope="session")
def vllm_server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_server(checkpoint, tmp_path_factory):
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"), "--engine", "hf",
                          "--max-frame-bytes", str(1 << 20))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference(checkpoint):
    """The transformers engine, in-process: the answer every server must give."""
    import asyncio

    from services.policy_server.engines import HfEngine
    from services.policy_server.policy_format import load_policy_spec

    spec = load_policy_spec(checkpoint)
    engine = HfEngine(spec)
    asyncio.run(engine.start())

    def actions_for(state, task):
        return spec.decode_actions(engine.generate_sync(spec.prompt_tokens(state, task)))

    return actions_for
