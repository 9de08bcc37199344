"""``evalforge up``: the whole evaluation stack as supervised local processes.

    evalforge up [--checkpoint [NAME=]DIR ...] [--replicas K] [--engine vllm|hf] [--workers 1]
                 [--concurrency N] [--port 8080] [--policy-port 8000] [--run-dir runs/stack]

What it starts, in order, after applying the database migrations:

Every port it needs (``--port``, ``--policy-port`` and the ones after it) is checked first:
one that something else holds fails ``evalforge up`` at once (exit 2) naming the port and
the flag. Health checks prove they reached the stack's own child: each gets a random
``EVALFORGE_INSTANCE_TOKEN`` that its health answer must echo (``services/supervisor.py``).

- ``api``: ``evalforge api`` on ``--port`` (health: ``GET /healthz``);
- ``policy-N``: one ``policy-server`` per ``--checkpoint``, on ``--policy-port``,
  ``+1``, … (health: ``GET /readyz``), registered with the API once ready; with
  ``--replicas K``, K servers of each checkpoint (``policy-N``, ``policy-N-2`` … ``policy-N-K``
  on K consecutive ports), registered as one policy with K endpoints, which the workers
  spread episodes over and fail over between (``services/workers/replicas.py``);
- ``worker-N``: ``--workers`` Celery workers (``evalforge worker``);
- ``sweeper``: ``evalforge sweeper``, which re-enqueues stranded episodes.

Embedded defaults, nothing to install beyond ``make setup``: the store is the SQLite
file of ``DATABASE_URL``'s default, and when neither ``REDIS_URL`` nor
``EVALFORGE_BROKER_URL`` is set, the Celery broker is the embedded filesystem broker
under ``RUN_DIR/broker`` (``services/queue.py``). Set ``DATABASE_URL`` and
``REDIS_URL`` to run the same processes on PostgreSQL and Redis.

Supervision is ``services.supervisor.Supervisor``'s: each process runs in a process group
of its own, so Ctrl-C reaches only ``evalforge up``, which then stops the children in reverse
order — SIGTERM to each group (the API and policy servers drain, Celery finishes its current
episode), SIGKILL to the group after ``--grace`` seconds. A child that exits is started again
after a back-off that doubles from 1 s to 30 s and resets once it has stayed up for a minute;
a child with a health URL that stops answering three checks in a row, or never answers within
its start-up budget, is killed and restarted the same way. Every child's output goes to
``RUN_DIR/logs/NAME.log`` (appended across restarts).

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
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.supervisor import ProcessSpec, Supervisor

log = logging.getLogger("evalforge.up")


# -- the stack ----------------------------------------------------------------------

@dataclass
class PolicyCheckpoint:
    name: str
    directory: Path
    port: int  # its first server's; replicas take the ports after it
    replicas: int = 1

    @property
    def ports(self) -> list[int]:
        return [self.port + r for r in range(self.replicas)]

    @property
    def endpoint(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def endpoints(self) -> list[str]:
        return [f"ws://127.0.0.1:{port}/ws" for port in self.ports]


def policy_process_name(index: int, replica: int) -> str:
    """``policy-N`` for a checkpoint's first server, ``policy-N-R`` for its R-th replica (R ≥ 2)."""
    return f"policy-{index + 1}" if replica == 0 else f"policy-{index + 1}-{replica + 1}"


def parse_checkpoints(values: Sequence[str], first_port: int, replicas: int = 1) -> list[PolicyCheckpoint]:
    """``[NAME=]DIR`` arguments → checkpoints with names (default: policy.json's) and ports (``replicas``
    consecutive ports each)."""
    from policy_format import CheckpointError, load_checkpoint

    checkpoints = []
    for index, value in enumerate(values):
        name, _, directory = value.rpartition("=") if "=" in value else ("", "", value)
        path = Path(directory).expanduser().resolve()
        try:
            spec = load_checkpoint(path)
        except (CheckpointError, OSError) as exc:
            raise SystemExit(f"evalforge up: --checkpoint {value}: {exc}") from None
        checkpoints.append(PolicyCheckpoint(name or spec.name, path, first_port + index * replicas, replicas))
    names = [c.name for c in checkpoints]
    if len(set(names)) != len(names):
        raise SystemExit(f"evalforge up: two checkpoints have the same name ({names}); "
                         "name them with --checkpoint NAME=DIR")
    return checkpoints


def stack_environment(run_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The children's environment: the store and broker made explicit, embedded where not configured."""
    from services.queue import embedded_broker_url
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
    from services.store.api_keys import ensure_api_key
    from services.store.db import create_db_engine, make_session_factory, session_scope

    engine = create_db_engine(url=database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return ensure_api_key(session, run_dir / "api-key", f"evalforge up ({run_dir})")
    finally:
        engine.dispose()


def build_specs(args: argparse.Namespace, checkpoints: list[PolicyCheckpoint]) -> list[ProcessSpec]:
    exe = [sys.executable, "-m"]
    api_url = f"http://{args.host}:{args.port}"
    specs = [ProcessSpec("api", [*exe, "services.cli", "api", "--host", args.host, "--port", str(args.port),
                                 "--log-level", "warning"],
                         health_url=f"{api_url}/healthz", startup_timeout_s=60, instance_token=True)]
    for index, checkpoint in enumerate(checkpoints):
        for replica, port in enumerate(checkpoint.ports):
            specs.append(ProcessSpec(
                policy_process_name(index, replica),
                [*exe, "services.policy_server", "--checkpoint", str(checkpoint.directory), "--port",
                 str(port), "--engine", args.engine, "--name", checkpoint.name, "--log-level", "warning",
                 # workers and simulators share this host: vLLM's scheduler stays on its compute cores
                 "--engine-core", "compute"],
                health_url=f"http://127.0.0.1:{port}/readyz", startup_timeout_s=600, instance_token=True))
    for index in range(args.workers):
        worker = [*exe, "services.cli", "worker", "--hostname", f"up-worker-{index + 1}@%h", "--log-level", "info"]
        if args.concurrency:
            worker += ["--concurrency", str(args.concurrency)]
        specs.append(ProcessSpec(f"worker-{index + 1}", worker))
    specs.append(ProcessSpec("sweeper", [*exe, "services.cli", "sweeper"]))
    return specs


def busy_ports(args: argparse.Namespace, checkpoints: list[PolicyCheckpoint]) -> list[str]:
    """One message per port the stack needs that something else already holds (port, flag, fix)."""
    wanted = [(args.host, args.port, "--port")]
    policy_ports = [port for c in checkpoints for port in c.ports]
    wanted += [("127.0.0.1", port, "--policy-port" if i == 0 else f"--policy-port (+{i})")
               for i, port in enumerate(policy_ports)]
    problems = []
    for host, port, flag in wanted:
        if not port_is_free(host, port):
            problems.append(f"port {port} on {host} ({flag}) is already in use by another process; stop it or "
                            f"pick another port with {flag.split()[0]}")
    return problems


def port_is_free(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (with SO_REUSEADDR, as uvicorn binds: a
    connection in TIME_WAIT does not count, another listener does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Stack:
    """The processes of one ``evalforge up``, and the files that describe it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir).resolve()
        self.checkpoints = parse_checkpoints(args.checkpoint or [], args.policy_port, getattr(args, "replicas", 1))
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
                               "endpoints": c.endpoints, "id": self.registered.get(c.name, {}).get("id")}
                              for c in self.checkpoints],
                 "processes": self.supervisor.snapshot()}
        tmp = self.run_dir / "stack.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.run_dir / "stack.json")

    def register_policies(self) -> None:
        from services.client import EvalForgeClient

        with EvalForgeClient(self.api_url, self.api_key) as client:
            for checkpoint in self.checkpoints:
                policy = client.register_policy(checkpoint.name, checkpoint.endpoint,
                                                replicas=checkpoint.endpoints[1:])
                self.registered[checkpoint.name] = policy.model_dump(mode="json")
                log.info("registered policy %s (id %s, version %s) at %s", checkpoint.name, policy.id,
                         policy.version, checkpoint.endpoint)
        self.write_state()

    def housekeeping(self) -> None:
        from services.queue import prune_processed

        now = time.monotonic()
        if now - self._last_prune > 60:
            self._last_prune = now
            prune_processed(self.env.get("EVALFORGE_BROKER_URL", ""))

    def up(self) -> int:
        from services.store import migrate

        # Before anything starts: a child that cannot bind would loop on "address already in
        # use" while a stranger on its port answered the health checks.
        problems = busy_ports(self.args, self.checkpoints)
        if problems:
            for problem in problems:
                print(f"evalforge up: {problem}", file=sys.stderr)
            return 2
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
            names = ["api", *[policy_process_name(i, r) for i, c in enumerate(self.checkpoints)
                              for r in range(c.replicas)]]
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
            lines.append(f"  policy {checkpoint.name} (id {policy.get('id')}) at {', '.join(checkpoint.endpoints)}")
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
