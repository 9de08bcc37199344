"""Run a Celery worker (prefork pool) that plays episodes from the episode queue.

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
    add_log_level(parser)
    parser.add_argument("--hostname", help="Celery node name (default: episodes-PID@HOST)")


def run(args: argparse.Namespace) -> int:
    from services.queue import settings
    from services.workers.celery_app import app

    concurrency = args.concurrency or os.cpu_count() or 1
    if concurrency < 1:
        print(f"evalforge worker: --concurrency must be at least 1, got {concurrency}", file=sys.stderr)
        return 2
    argv = ["worker", "--pool", "prefork", "--concurrency", str(concurrency), "--queues", settings.episode_queue,
            "--loglevel", args.log_level,
            "--hostname", args.hostname or f"episodes-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle"]
    app.worker_main(argv)
    return 0
