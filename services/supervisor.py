"""Child processes in process groups of their own: how EvalForge starts, health-checks and stops them.

One implementation serves ``evalforge up`` (``services/stack.py``), the policy-server launcher
(``trainer rollout``, the benchmarks, the tests), ``make demo`` and the benchmarks' helpers:

- :class:`ChildProcess`: one command, its output in a log file, started in a process group of
  its own. ``wait_healthy`` polls its health (an HTTP URL that answers 200, or a callable) and
  raises :class:`StartupError` — naming the command and its log — when the child exits first or
  the time is up. ``stop`` sends SIGTERM to the whole group (servers drain, Celery finishes its
  episode), SIGKILL to the group after the grace period, and SIGKILL once more to whatever the
  group still holds (Celery's pool processes, vLLM's engine core): nothing is left behind. A
  context manager: ``with ChildProcess(...) as child:`` starts, waits until healthy, and stops.
- :class:`PolicyServerProcess`: ``python -m services.policy_server`` on a free loopback port,
  healthy once ``/readyz`` answers 200.
- :class:`Supervisor`: a set of :class:`ProcessSpec` children kept up — a child that exits is
  started again after a back-off that doubles from 1 s to 30 s (reset once it stayed up a
  minute); a child with a health URL that fails three checks in a row, or never answers within
  its start-up budget, is stopped and restarted the same way; ``stop_all`` stops them last
  started first. A spec with ``instance_token`` proves the answer is its own child's: each
  start gets a fresh random ``EVALFORGE_INSTANCE_TOKEN`` in its environment, the child's
  health answer echoes it as JSON ``"instance"`` (the API's ``/healthz``, the policy
  server's ``/healthz`` and ``/readyz``), and only a 200 carrying that token is healthy — a
  stranger on the port (another API, a plain listener) never makes the stack "ready".

Why a process group in the caller's session, not a new session: a Ctrl-C at the terminal
reaches only the foreground group (the caller, which then stops its children in order), and
the group is what ``stop`` signals. But the session stays the caller's: vLLM's engine core
busy-waits with ``sched_yield()``, which under Linux's session autogroups yields only to
processes of its own session, and local clients in another session stalled behind it
(docs/benchmarks.md, "Policy server").

Standard library only, so every part of ``services`` (the workers included) and every tool may
import it without the serving stack.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ChildProcess",
    "PolicyServerProcess",
    "ProcessSpec",
    "StartupError",
    "Supervisor",
    "answers_as_instance",
    "free_port",
    "http_ok",
    "http_status",
]

log = logging.getLogger("evalforge.supervisor")

# Health checks go to loopback or to URLs the caller named: never through an http_proxy of the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may still take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """The status code of ``GET url``, or None when nothing answers (yet)."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:  # a 503 from /readyz is an answer, not a failure
        return exc.code
    except OSError:  # refused, reset or timed out: nothing listens there yet
        return None


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200."""
    return http_status(url, timeout_s) == 200


INSTANCE_TOKEN_ENV = "EVALFORGE_INSTANCE_TOKEN"
"""The variable a supervised child's health answer echoes as ``"instance"`` (see ``ProcessSpec.instance_token``)."""


def answers_as_instance(url: str, token: str, timeout_s: float = 2.0) -> bool:
    """Whether ``GET url`` answers 200 with JSON whose ``"instance"`` is ``token``: our own child, not a stranger."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            body = json.loads(response.read(65536))
    except (OSError, ValueError):  # nothing there, an error status, or not JSON: not our child
        return False
    return isinstance(body, dict) and secrets.compare_digest(str(body.get("instance", "")), token)


class StartupError(RuntimeError):
    """A child exited, or did not become healthy in time; the message names its command and log."""


Health = str | Callable[[], bool] | None


class ChildProcess:
    """One command in a process group of its own, its output in ``log_path`` (see the module docstring).

    ``health``: an HTTP URL that answers 200 once the child is ready, a callable that returns
    True then, or None (running is healthy). ``env``: the child's whole environment (default:
    this process's), with ``PYTHONUNBUFFERED=1`` added so its log is current. ``append_log``
    keeps what earlier runs wrote (a restarted child); otherwise the log starts empty.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, *, health: Health = None,
                 env: Mapping[str, str] | None = None, cwd: Path | str | None = None, grace_s: float = 30.0,
                 startup_timeout_s: float = 120.0, append_log: bool = False) -> None:
        self.argv = [str(arg) for arg in argv]
        self.log_path = Path(log_path)
        self.health = health
        self.env = env
        self.cwd = cwd
        self.grace_s = grace_s
        self.startup_timeout_s = startup_timeout_s
        self.append_log = append_log
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    @property
    def pid(self) -> int | None:
        """The child's pid (= its process group id) while it runs; None before it started and after it exited."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, chars: int = 4000) -> str:
        """The end of the child's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self) -> ChildProcess:
        """Start the child (without waiting for it to be healthy)."""
        if self.running():
            raise RuntimeError(f"{self.command} is already running (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**(os.environ if self.env is None else self.env), "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("ab" if self.append_log else "wb") as logfile:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.cwd, process_group=0)
        return self

    def healthy(self) -> bool:
        """One health check: running, and its URL answers 200 or its callable says so."""
        if not self.running():
            return False
        if self.health is None:
            return True
        if isinstance(self.health, str):
            return http_ok(self.health)
        return bool(self.health())

    def wait_healthy(self, timeout_s: float | None = None, poll_s: float = 0.2) -> ChildProcess:
        """Wait until the child is healthy; on exit or timeout raise ``StartupError`` (a timed-out child is stopped)."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None:
                raise RuntimeError(f"{self.command} was not started: call start() first")
            code = self.proc.poll()
            if code is not None:
                self.kill_group()
                raise StartupError(f"`{self.command}` exited with code {code} before it was healthy; "
                                   f"its log {self.log_path} ends:\n{self.log()}")
            if self.healthy():
                return self
            if time.monotonic() >= deadline:
                self.stop()
                what = self.health if isinstance(self.health, str) else "its health check"
                raise StartupError(f"`{self.command}` was not healthy ({what}) within {timeout_s:g} s and was "
                                   f"stopped; its log {self.log_path} ends:\n{self.log()}")
            time.sleep(poll_s)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (nothing if the group is gone)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the child's process group (grandchildren of an exited child)."""
        self.signal_group(signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float | None = None) -> int | None:
        """Send ``sig`` to the group, SIGKILL the group after ``grace_s``; returns the child's exit status."""
        if self.proc is None:
            return None
        grace_s = self.grace_s if grace_s is None else grace_s
        if self.proc.poll() is None:
            self.signal_group(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %g s of signal %d; killing its process group", self.command,
                            grace_s, sig)
                self.kill_group()
                self.proc.wait()
        self.kill_group()
        return self.proc.returncode

    def __enter__(self) -> ChildProcess:
        self.start()
        try:
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PolicyServerProcess(ChildProcess):
    """``policy-server`` on a free loopback port, for tools, benchmarks and tests.

        with PolicyServerProcess(checkpoint, "--engine", "hf") as server:
            client = PolicyClient(server.ws_url)

    ``start()`` returns once ``/readyz`` says ready (and records in ``ready_when_first_healthy``
    whether the engine was already warm when ``/healthz`` first answered); ``stop()`` sends
    SIGTERM, so the server drains. It runs the server in a child process and imports no server
    code, so a client can start a server without the serving stack in its own process.
    """

    def __init__(self, checkpoint: str | Path, *args: str, log_dir: Path | None = None, port: int | None = None,
                 grace_s: float = 60.0) -> None:
        self.checkpoint = Path(checkpoint)
        self.args = args
        self.port = port or free_port()
        super().__init__([], (log_dir or Path(tempfile.gettempdir())) / f"policy-server-{self.port}.log",
                         health=self._ready, grace_s=grace_s, startup_timeout_s=300.0)
        self.ready_when_first_healthy: bool | None = None

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        if http_status(f"{self.http_url}/healthz") != 200:
            return False
        ready = http_status(f"{self.http_url}/readyz") == 200
        if self.ready_when_first_healthy is None:
            self.ready_when_first_healthy = ready
        return ready

    def start(self, timeout: float | None = None) -> PolicyServerProcess:
        """Start the server and wait until it is ready, or raise ``StartupError`` with the end of its log."""
        self.argv = [sys.executable, "-m", "services.policy_server", "--checkpoint", str(self.checkpoint),
                     "--port", str(self.port), *self.args]  # built here: callers may set .port first
        super().start()
        self.wait_healthy(timeout)
        return self

    def __enter__(self) -> PolicyServerProcess:
        return self.start()


# -- a set of children, kept up -------------------------------------------------------------------

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
HEALTH_EVERY_S = 2.0
UNHEALTHY_AFTER = 3


@dataclass
class ProcessSpec:
    """One supervised child: its command line and how to tell it is healthy."""

    name: str
    argv: list[str]
    health_url: str | None = None
    """An HTTP URL that answers 200 while the process is healthy; ``None``: alive is healthy."""
    startup_timeout_s: float = 120.0
    """How long after a (re)start the health URL may stay silent before the process is restarted."""
    env: dict[str, str] = field(default_factory=dict)
    instance_token: bool = False
    """Pass a fresh ``EVALFORGE_INSTANCE_TOKEN`` at each start; healthy only when the health URL echoes it."""


@dataclass
class ChildState:
    """What the supervisor knows of one child."""

    spec: ProcessSpec
    process: ChildProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None
    healthy: bool = False
    failed_checks: int = 0
    next_check_at: float = 0.0
    last_exit: int | None = None
    token: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Supervisor:
    """Starts, watches, restarts and stops a set of child processes (see the module docstring)."""

    def __init__(self, specs: Sequence[ProcessSpec], log_dir: Path, *, env: dict[str, str] | None = None,
                 on_change: Callable[[Supervisor], None] | None = None,
                 health_check: Callable[[str], bool] = http_ok, backoff_start_s: float = BACKOFF_START_S,
                 backoff_max_s: float = BACKOFF_MAX_S, stable_after_s: float = STABLE_AFTER_S,
                 health_every_s: float = HEALTH_EVERY_S, unhealthy_after: int = UNHEALTHY_AFTER) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.children = {spec.name: ChildState(spec, backoff_s=backoff_start_s) for spec in specs}
        self.backoff_start_s, self.backoff_max_s, self.stable_after_s = backoff_start_s, backoff_max_s, stable_after_s
        self.health_every_s, self.unhealthy_after = health_every_s, unhealthy_after
        self.log_dir = log_dir
        self.env = dict(os.environ if env is None else env)
        self.on_change = on_change
        self.health_check = health_check
        self.stopping = threading.Event()

    # -- one child ------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _start(self, child: ChildState) -> None:
        path = self.log_path(child.spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as logfile:
            logfile.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {child.spec.name} "
                          f"(restart {child.restarts}): {' '.join(child.spec.argv)}\n".encode())
        env = {**self.env, **child.spec.env}
        child.token = secrets.token_hex(16) if child.spec.instance_token else None
        if child.token is not None:
            env[INSTANCE_TOKEN_ENV] = child.token
        child.process = ChildProcess(child.spec.argv, path, env=env, append_log=True).start()
        now = time.monotonic()
        child.started_at, child.restart_at, child.healthy, child.failed_checks = now, None, False, 0
        child.next_check_at = now + 0.5
        log.info("started %s (pid %d)", child.spec.name, child.process.proc.pid)
        self._changed()

    def _schedule_restart(self, child: ChildState, why: str) -> None:
        now = time.monotonic()
        if now - child.started_at >= self.stable_after_s:
            child.backoff_s = self.backoff_start_s
        child.restart_at = now + child.backoff_s
        child.healthy = False
        log.warning("%s %s; restarting in %.0f s (log: %s)", child.spec.name, why, child.backoff_s,
                    self.log_path(child.spec.name))
        child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)
        child.restarts += 1
        self._changed()

    def _stop(self, child: ChildState, grace_s: float) -> int | None:
        if child.process is None:
            return None
        return child.process.stop(grace_s=grace_s)

    def _check(self, child: ChildState) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at and not self.stopping.is_set():
                self._start(child)
            return
        process = child.process
        if process is None:
            return
        code = process.returncode
        if code is not None:
            child.last_exit = code
            process.kill_group()
            self._schedule_restart(child, f"exited with code {code}")
            return
        if child.spec.health_url is None:
            if not child.healthy:
                child.healthy = True
                self._changed()
            return
        if now < child.next_check_at:
            return
        child.next_check_at = now + self.health_every_s
        if (answers_as_instance(child.spec.health_url, child.token) if child.token is not None
                else self.health_check(child.spec.health_url)):
            child.failed_checks = 0
            if not child.healthy:
                child.healthy = True
                log.info("%s is healthy (%s)", child.spec.name, child.spec.health_url)
                self._changed()
            return
        if child.healthy:
            child.failed_checks += 1
            if child.failed_checks >= self.unhealthy_after:
                self._stop(child, grace_s=5.0)
                self._schedule_restart(child, f"failed {child.failed_checks} health checks in a row")
        elif now - child.started_at > child.spec.startup_timeout_s:
            self._stop(child, grace_s=5.0)
            self._schedule_restart(child, f"was not healthy within {child.spec.startup_timeout_s:.0f} s of starting")

    # -- all of them ------------------------------------------------------------------
    def start_all(self) -> None:
        for child in self.children.values():
            self._start(child)

    def tick(self) -> None:
        """One round of checks: restart what exited or went unhealthy."""
        for child in self.children.values():
            self._check(child)

    def healthy(self, names: Sequence[str] | None = None) -> bool:
        return all(self.children[name].healthy for name in (names or list(self.children)))

    def wait_healthy(self, names: Sequence[str], timeout_s: float, poll_s: float = 0.25) -> bool:
        """Supervise until ``names`` are healthy (True) or ``timeout_s`` passed or stop was asked (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.stopping.is_set() and time.monotonic() < deadline:
            self.tick()
            if self.healthy(names):
                return True
            self.stopping.wait(poll_s)
        return False

    def run(self, poll_s: float = 0.5, every: Callable[[], None] | None = None) -> None:
        """Supervise until :meth:`request_stop`; ``every`` runs once per round."""
        while not self.stopping.is_set():
            self.tick()
            if every is not None:
                every()
            self.stopping.wait(poll_s)

    def request_stop(self) -> None:
        self.stopping.set()

    def stop_all(self, grace_s: float = 20.0) -> dict[str, int | None]:
        """Stop every child, last started first; returns their exit codes."""
        self.stopping.set()
        codes = {}
        for child in reversed(list(self.children.values())):
            if child.pid is not None:
                log.info("stopping %s (pid %d)", child.spec.name, child.pid)
            codes[child.spec.name] = self._stop(child, grace_s)
            child.healthy = False
        self._changed()
        return codes

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: {"pid": c.pid, "healthy": c.healthy, "restarts": c.restarts, "last_exit": c.last_exit,
                       "health_url": c.spec.health_url, "log": str(self.log_path(name))}
                for name, c in self.children.items()}

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)
