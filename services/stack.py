"""``evalforge up``: the whole evaluation stack as supervised local processes.

    evalforge up [--checkpoint [NAME=]DIR ...] [--engine vllm|hf] [--workers 1] [--concurrency N]
                 [--port 8080] [--policy-port 8000] [--run-dir runs/stack]

What it starts, in order, after applying the database migrations:

- ``api``: ``evalforge api`` on ``--port`` (health: ``GET /healthz``);
- ``policy-N``: one ``policy-server`` per ``--checkpoint``, on ``--policy-port``,
  ``+1``, … (health: ``GET /readyz``), registered with the API once ready;
- ``worker-N``: ``--workers`` Celery workers (``evalforge worker``);
- ``sweeper``: ``evalforge sweeper``, which re-enqueues stranded episodes.

Embedded defaults, nothing to install beyond ``make setup``: the store is the SQLite
file of ``DATABASE_URL``'s default, and when neither ``REDIS_URL`` nor
``EVALFORGE_BROKER_URL`` is set, the Celery broker is the embedded filesystem broker
under ``RUN_DIR/broker`` (``services/broker.py``). Set ``DATABASE_URL`` and
``REDIS_URL`` to run the same processes on PostgreSQL and Redis.

Supervision (:class:`Supervisor`): each process runs in its own session (process
group), so Ctrl-C reaches only the supervisor, which then stops the children in
reverse order — SIGTERM (the API and policy servers drain, Celery finishes its
current episode), SIGKILL after ``--grace`` seconds. A child that exits is started
again after a back-off that doubles from 1 s to 30 s and resets once it has stayed up
for a minute; a child with a health URL that stops answering three checks in a row,
or never answers within its start-up budget, is killed and restarted the same way.
Every child's output goes to ``RUN_DIR/logs/NAME.log`` (appended across restarts).

The stack writes ``RUN_DIR/stack.json`` (URLs, pids, registered policies; rewritten
on every change, ``"status": "ready"`` once everything is up), ``RUN_DIR/api-key``
(a write key it created, mode 600) and ``RUN_DIR/stack.env`` (``EVALFORGE_API_URL``
and ``EVALFORGE_API_KEY`` for ``source``), so ``evalforge eval …`` and scripts can
talk to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("evalforge.up")

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


@dataclass
class ChildState:
    """What the supervisor knows of one child."""

    spec: ProcessSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    restart_at: float | None = None
    healthy: bool = False
    failed_checks: int = 0
    next_check_at: float = 0.0
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


class Supervisor:
    """Starts, watches, restarts and stops a set of child processes (see the module docstring)."""

    def __init__(self, specs: Sequence[ProcessSpec], log_dir: Path, *, env: dict[str, str] | None = None,
                 on_change: Callable[[Supervisor], None] | None = None,
                 health_check: Callable[[str], bool] = _http_ok, backoff_start_s: float = BACKOFF_START_S,
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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logfile: IO[bytes] = self.log_path(child.spec.name).open("ab")
        logfile.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {child.spec.name} "
                      f"(restart {child.restarts}): {' '.join(child.spec.argv)}\n".encode())
        logfile.flush()
        env = {**self.env, "PYTHONUNBUFFERED": "1", **child.spec.env}
        # Own process group (killed as one), same session: see PolicyServerProcess.start.
        try:
            child.proc = subprocess.Popen(child.spec.argv, stdout=logfile, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, process_group=0)
        finally:
            logfile.close()  # the child holds its own descriptor
        now = time.monotonic()
        child.started_at, child.restart_at, child.healthy, child.failed_checks = now, None, False, 0
        child.next_check_at = now + 0.5
        log.info("started %s (pid %d)", child.spec.name, child.proc.pid)
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

    def _kill(self, child: ChildState, grace_s: float) -> int | None:
        proc = child.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM; killing it", child.spec.name, grace_s)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        # Celery's pool processes and vLLM's engine core live in the child's group: leave none behind.
        _signal_group(proc, signal.SIGKILL)
        return proc.returncode

    def _check(self, child: ChildState) -> None:
        now = time.monotonic()
        if child.restart_at is not None:
            if now >= child.restart_at and not self.stopping.is_set():
                self._start(child)
            return
        proc = child.proc
        if proc is None:
            return
        code = proc.poll()
        if code is not None:
            child.last_exit = code
            _signal_group(proc, signal.SIGKILL)
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
        if self.health_check(child.spec.health_url):
            child.failed_checks = 0
            if not child.healthy:
                child.healthy = True
                log.info("%s is healthy (%s)", child.spec.name, child.spec.health_url)
                self._changed()
            return
        if child.healthy:
            child.failed_checks += 1
            if child.failed_checks >= self.unhealthy_after:
                self._kill(child, grace_s=5.0)
                self._schedule_restart(child, f"failed {child.failed_checks} health checks in a row")
        elif now - child.started_at > child.spec.startup_timeout_s:
            self._kill(child, grace_s=5.0)
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
            if child.proc is not None and child.proc.poll() is None:
                log.info("stopping %s (pid %d)", child.spec.name, child.proc.pid)
            codes[child.spec.name] = self._kill(child, grace_s)
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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- the stack ----------------------------------------------------------------------

@dataclass
class PolicyCheckpoint:
    name: str
    directory: Path
    port: int

    @property
    def endpoint(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"


def parse_checkpoints(values: Sequence[str], first_port: int) -> list[PolicyCheckpoint]:
    """``[NAME=]DIR`` arguments → checkpoints with names (default: policy.json's) and ports."""
    from services.policy_server.policy_format import CheckpointError, load_policy_spec

    checkpoints = []
    for index, value in enumerate(values):
        name, _, directory = value.rpartition("=") if "=" in value else ("", "", value)
        path = Path(directory).expanduser().resolve()
        try:
            spec = load_policy_spec(path)
        except (CheckpointError, OSError) as exc:
            raise SystemExit(f"evalforge up: --checkpoint {value}: {exc}") from None
        checkpoints.append(PolicyCheckpoint(name or spec.name, path, first_port + index))
    names = [c.name for c in checkpoints]
    if len(set(names)) != len(names):
        raise SystemExit(f"evalforge up: two checkpoints have the same name ({names}); "
                         "name them with --checkpoint NAME=DIR")
    return checkpoints


def stack_environment(run_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The children's environment: the store and broker made explicit, embedded where not configured."""
    from services.broker import embedded_broker_url
    from services.store.settings import StoreSettings

    env = dict(environ)
    database_url = StoreSettings().database_url
    if database_url.startswith("sqlite:///") and not database_url.startswith("sqlite:////"):
        # relative SQLite path → absolute, so every child opens the same file
        path = Path(database_url.removeprefix("sqlite:///")).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        database_url = f"sqlite:///{path}"
    env["DATABASE_URL"] = database_url
    if not env.get("EVALFORGE_BROKER_URL") and not env.get("REDIS_URL"):
        env["EVALFORGE_BROKER_URL"] = embedded_broker_url(run_dir / "broker")
    return env


def stack_api_key(run_dir: Path, database_url: str) -> str:
    """The stack's write key: the one in ``RUN_DIR/api-key`` if the store still accepts it, else a new one."""
    from services.store.api_keys import authenticate, create_api_key
    from services.store.db import make_engine, make_session_factory, session_scope

    key_file = run_dir / "api-key"
    engine = make_engine(url=database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            if key_file.is_file():
                key = key_file.read_text().strip()
                if key and authenticate(session, key) is not None:
                    return key
            _, key = create_api_key(session, f"evalforge up ({run_dir})")
    finally:
        engine.dispose()
    key_file.touch(mode=0o600)
    key_file.write_text(key + "\n")
    return key


def build_specs(args: argparse.Namespace, checkpoints: list[PolicyCheckpoint]) -> list[ProcessSpec]:
    exe = [sys.executable, "-m"]
    api_url = f"http://{args.host}:{args.port}"
    specs = [ProcessSpec("api", [*exe, "services.cli", "api", "--host", args.host, "--port", str(args.port),
                                 "--log-level", "warning"],
                         health_url=f"{api_url}/healthz", startup_timeout_s=60)]
    for index, checkpoint in enumerate(checkpoints):
        specs.append(ProcessSpec(
            f"policy-{index + 1}",
            [*exe, "services.policy_server", "--checkpoint", str(checkpoint.directory), "--port",
             str(checkpoint.port), "--engine", args.engine, "--name", checkpoint.name, "--log-level", "warning",
             # workers and simulators share this host: vLLM's scheduler stays on its compute cores
             "--engine-core", "compute"],
            health_url=f"http://127.0.0.1:{checkpoint.port}/readyz", startup_timeout_s=600))
    for index in range(args.workers):
        worker = [*exe, "services.cli", "worker", "--hostname", f"up-worker-{index + 1}@%h", "--loglevel", "info"]
        if args.concurrency:
            worker += ["--concurrency", str(args.concurrency)]
        specs.append(ProcessSpec(f"worker-{index + 1}", worker))
    specs.append(ProcessSpec("sweeper", [*exe, "services.cli", "sweeper"]))
    return specs


class Stack:
    """The processes of one ``evalforge up``, and the files that describe it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir).resolve()
        self.checkpoints = parse_checkpoints(args.checkpoint or [], args.policy_port)
        self.api_url = f"http://{args.host}:{args.port}"
        self.env = stack_environment(self.run_dir, dict(os.environ))
        self.registered: dict[str, dict[str, Any]] = {}
        self.api_key = ""  # the stack's write key, created or reused once migrations ran
        self.status = "starting"
        self.supervisor = Supervisor(build_specs(args, self.checkpoints), self.run_dir / "logs", env=self.env,
                                     on_change=lambda _: self.write_state())
        self._last_prune = 0.0

    def write_state(self) -> None:
        state = {"status": self.status, "api_url": self.api_url, "api_key_file": str(self.run_dir / "api-key"),
                 "database_url": _hide_password(self.env["DATABASE_URL"]),
                 "broker_url": _hide_password(self.env.get("EVALFORGE_BROKER_URL") or self.env.get("REDIS_URL", "")),
                 "supervisor_pid": os.getpid(),
                 "policies": [{"name": c.name, "checkpoint": str(c.directory), "endpoint": c.endpoint,
                               "id": self.registered.get(c.name, {}).get("id")} for c in self.checkpoints],
                 "processes": self.supervisor.snapshot()}
        tmp = self.run_dir / "stack.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.run_dir / "stack.json")

    def register_policies(self) -> None:
        from services.client import EvalForgeClient

        with EvalForgeClient(self.api_url, self.api_key) as client:
            for checkpoint in self.checkpoints:
                policy = client.register_policy(checkpoint.name, checkpoint.endpoint)
                self.registered[checkpoint.name] = policy
                log.info("registered policy %s (id %s, version %s) at %s", checkpoint.name, policy["id"],
                         policy.get("version"), checkpoint.endpoint)
        self.write_state()

    def housekeeping(self) -> None:
        from services.broker import prune_processed

        now = time.monotonic()
        if now - self._last_prune > 60:
            self._last_prune = now
            prune_processed(self.env.get("EVALFORGE_BROKER_URL", ""))

    def up(self) -> int:
        from services.store import migrate

        self.run_dir.mkdir(parents=True, exist_ok=True)
        print(f"evalforge up: store {_hide_password(self.env['DATABASE_URL'])}; broker "
              f"{_hide_password(self.env.get('EVALFORGE_BROKER_URL') or self.env['REDIS_URL'])}", flush=True)
        migrate.upgrade(self.env["DATABASE_URL"])
        self.api_key = stack_api_key(self.run_dir, self.env["DATABASE_URL"])
        (self.run_dir / "stack.env").write_text(f"export EVALFORGE_API_URL={self.api_url}\n"
                                                f"export EVALFORGE_API_KEY=$(cat {self.run_dir / 'api-key'})\n")
        stop = self.supervisor.request_stop
        previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.supervisor.start_all()
            names = ["api", *[f"policy-{i + 1}" for i in range(len(self.checkpoints))]]
            if not self.supervisor.wait_healthy(names, timeout_s=self.args.ready_timeout):
                if self.supervisor.stopping.is_set():
                    return 0
                bad = [n for n in names if not self.supervisor.children[n].healthy]
                print(f"evalforge up: {', '.join(bad)} not healthy after {self.args.ready_timeout:.0f} s; "
                      f"see {self.run_dir / 'logs'}", file=sys.stderr)
                return 1
            self.register_policies()
            self.status = "ready"
            self.write_state()
            self._print_ready()
            self.supervisor.run(every=self.housekeeping)
            return 0
        finally:
            self.status = "stopping"
            self.supervisor.stop_all(grace_s=self.args.grace)
            self.status = "stopped"
            self.write_state()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            print("evalforge up: stopped", flush=True)

    def _print_ready(self) -> None:
        lines = [f"evalforge up: ready — API {self.api_url} (docs {self.api_url}/docs)"]
        for checkpoint in self.checkpoints:
            policy = self.registered.get(checkpoint.name, {})
            lines.append(f"  policy {checkpoint.name} (id {policy.get('id')}) at {checkpoint.endpoint}")
        lines.append(f"  {self.args.workers} worker(s), sweeper; logs in {self.run_dir / 'logs'}")
        lines.append(f"  for the CLI: source {self.run_dir / 'stack.env'}")
        lines.append("  Ctrl-C stops everything.")
        print("\n".join(lines), flush=True)


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True) if "://" in url and "@" in url else url
    except Exception:
        return url


def add_up_verb(verbs: argparse._SubParsersAction) -> None:
    up = verbs.add_parser("up", help="start the whole stack as supervised local processes (Ctrl-C stops it)",
                          description=__doc__.split("\n\n")[0])
    up.add_argument("--checkpoint", action="append", metavar="[NAME=]DIR",
                    help="serve this policy checkpoint and register it (repeatable)")
    up.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="policy-server engine (default vllm)")
    up.add_argument("--workers", type=int, default=1, help="Celery worker processes (default 1)")
    up.add_argument("--concurrency", type=int, help="episodes at once per worker (default: CPU cores)")
    up.add_argument("--host", default="127.0.0.1", help="API bind address (default: loopback only)")
    up.add_argument("--port", type=int, default=8080, help="API port (default 8080)")
    up.add_argument("--policy-port", type=int, default=8000, help="first policy-server port (default 8000)")
    up.add_argument("--run-dir", default="runs/stack", help="logs, stack.json, api-key (default runs/stack)")
    up.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the stack to be up")
    up.add_argument("--grace", type=float, default=30.0, help="seconds a process gets to stop before SIGKILL")
    up.set_defaults(handler=_cmd_up)


def _cmd_up(args: argparse.Namespace) -> int:
    if args.workers < 0:
        print(f"evalforge up: --workers must be 0 or more, got {args.workers}", file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print(f"evalforge up: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "alembic"):  # one line per health check or migration step is noise here
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return Stack(args).up()
