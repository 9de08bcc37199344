"""Run a Celery worker (prefork pool) that plays episodes from the queues of its simulator families.

Each simulator family has its own episode queue (``services.queue.queue_name``:
``episodes.metaworld``, ``episodes.libero``…). A worker consumes the queues of
``--simulators`` (default: every family installed in its environment,
``benchmarks.simulators.available_simulators``) and the bare ``episodes`` queue, and says
so in the store through its heartbeat (``services/workers/heartbeat.py``), so the API
knows which pools are live. A family whose pins clash with the others runs in an
environment of its own with its own worker: ``pip install 'evalforge[services,sim-libero]'``
there, then ``evalforge worker --simulators libero``.

The broker and the queue come from REDIS_URL / EVALFORGE_BROKER_URL and
EVALFORGE_EPISODE_QUEUE (services/queue.py), the store from DATABASE_URL.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from services.cli import add_log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, metavar="N",
                        help="episode processes (default: the number of CPU cores)")
    parser.add_argument("--episodes-in-flight", type=int, metavar="N", help=(
        "play up to N episodes at once in this one process, each in a thread with its own simulator and "
        "policy connection (services/workers/inflight.py); instead of --concurrency"))
    parser.add_argument("--simulators", metavar="FAMILY[,FAMILY...]", help=(
        "simulator families to serve (metaworld, gym-pusht, libero, aloha, ogbench; default: every one "
        "installed here)"))
    add_log_level(parser)
    parser.add_argument("--hostname", help="Celery node name (default: episodes-PID@HOST)")


def chosen_simulators(value: str | None) -> list[str]:
    """``--simulators`` checked against what is installed; ``ValueError`` naming the problem and the fix."""
    from benchmarks.simulators import (
        SIMULATOR_PACKAGES,
        available_simulators,
        install_hint,
        is_available,
    )

    if value is None:
        available = available_simulators()
        if not available:
            raise ValueError("no simulator family is installed here; install one, e.g. "
                             "pip install 'evalforge[sim-metaworld]'")
        return available
    families = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in families if name not in SIMULATOR_PACKAGES]
    if unknown or not families:
        raise ValueError(f"--simulators {value!r}: unknown family {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(SIMULATOR_PACKAGES)}")
    missing = [name for name in families if not is_available(name)]
    if missing:
        raise ValueError(f"--simulators: {', '.join(missing)} not installed in this environment ({sys.prefix}); "
                         + install_hint(missing))
    return families


def run(args: argparse.Namespace) -> int:
    from services.queue import queue_name, settings
    from services.store.db import create_db_engine, make_session_factory
    from services.workers import inflight
    from services.workers.celery_app import app
    from services.workers.heartbeat import WorkerHeartbeat
    from services.workers.settings import settings as worker_settings

    concurrency = args.concurrency or os.cpu_count() or 1
    if concurrency < 1:
        print(f"evalforge worker: --concurrency must be at least 1, got {concurrency}", file=sys.stderr)
        return 2
    in_flight = getattr(args, "episodes_in_flight", None)
    if in_flight is not None:
        from services.store.settings import settings as store_settings

        try:
            if args.concurrency not in (None, 1):
                raise ValueError(f"--episodes-in-flight runs one process; drop --concurrency {args.concurrency} "
                                 "and start more workers for more processes")
            pool = inflight.celery_pool_arguments(in_flight)
            inflight.check_database_pool(in_flight, store_settings.pool_size, store_settings.max_overflow)
        except ValueError as exc:
            print(f"evalforge worker: {exc}", file=sys.stderr)
            return 2
    else:
        pool = ["--pool", "prefork", "--concurrency", str(concurrency)]
    try:
        simulators = chosen_simulators(args.simulators)
    except ValueError as exc:
        print(f"evalforge worker: {exc}", file=sys.stderr)
        return 2
    hostname = args.hostname or f"episodes-{os.getpid()}@{socket.gethostname()}"
    queues = [settings.episode_queue, *(queue_name(family) for family in simulators)]
    # Its row is named as Celery names the node (%h is Celery's placeholder for the host name).
    heartbeat = WorkerHeartbeat(make_session_factory(create_db_engine()), hostname.replace("%h", socket.gethostname()),
                                simulators, every_s=worker_settings.pool_heartbeat_s).start()
    argv = ["worker", *pool, "--queues", ",".join(queues),
            "--loglevel", args.log_level, "--hostname", hostname, "--without-gossip", "--without-mingle"]
    watchdog = inflight.install_watchdog() if in_flight is not None else None
    try:
        app.worker_main(argv)
    finally:
        if watchdog is not None:
            watchdog.stop()
        heartbeat.stop()
    return 0
