"""A `policy-server` subprocess on a free loopback port, for tools, benchmarks and tests.

    with PolicyServerProcess(checkpoint, "--engine", "hf") as server:
        client = PolicyClient(server.ws_url)

``start()`` returns once ``/readyz`` says ready (and records whether ``/healthz``
answered before the engine was warm); ``stop()`` sends SIGTERM, so the server
drains, and kills it only if it does not exit in time.

It runs ``python -m services.policy_server`` in a child process and imports no
server code, so a client (the ``rollout`` command, a benchmark, a test) can start
a server without the serving stack in its own process. Standard library only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# The server is on loopback: never route its health checks through an http_proxy from the environment.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may still take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_status(url: str) -> int | None:
    """The status code of ``GET url``, or None when nothing answers (yet)."""
    try:
        with _LOOPBACK.open(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as exc:  # a 503 from /readyz is an answer, not a failure
        return exc.code
    except OSError:  # refused, reset or timed out: the server is not listening yet
        return None


class PolicyServerProcess:
    def __init__(self, checkpoint: str | Path, *args: str, log_dir: Path | None = None) -> None:
        self.checkpoint = Path(checkpoint)
        self.args = args
        self.port = free_port()
        self.log_path = (log_dir or Path(tempfile.gettempdir())) / f"policy-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.ready_when_first_healthy: bool | None = None

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def start(self, timeout: float = 300) -> PolicyServerProcess:
        """Start the server and wait until it is ready, or raise with the end of its log."""
        # Its own process group (a Ctrl-C at the terminal reaches only the caller, which
        # stops it), in this session: vLLM's engine core busy-waits with sched_yield(),
        # which with Linux's session autogroups yields only to processes of its own
        # session; local clients in another session stalled behind it (docs/benchmarks.md).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.policy_server", "--checkpoint", str(self.checkpoint),
             "--port", str(self.port), *self.args],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, process_group=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"policy-server exited with {self.proc.returncode}:\n{self.log()}")
            if _http_status(f"{self.http_url}/healthz") == 200:
                ready = _http_status(f"{self.http_url}/readyz") == 200
                if self.ready_when_first_healthy is None:
                    self.ready_when_first_healthy = ready
                if ready:
                    return self
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"policy-server did not become ready in {timeout:g} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal the server (SIGTERM drains) and wait; returns its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> PolicyServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
