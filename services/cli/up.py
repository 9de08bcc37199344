"""Start the whole evaluation stack as supervised local processes; Ctrl-C stops it.

Starts the API, one policy server per --checkpoint (--replicas K: K of them, one
policy with K endpoints; registered with the API once ready), --workers Celery
workers and the sweeper, after applying the database migrations; restarts any
that exit or stop answering. Embedded defaults (SQLite, a filesystem broker under
RUN_DIR/broker) unless DATABASE_URL and REDIS_URL are set. RUN_DIR/stack.json,
RUN_DIR/api-key and RUN_DIR/stack.env say how to reach it. The stack itself is
services/stack.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.cli import add_log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", action="append", metavar="[NAME=]DIR",
                        help="serve this policy checkpoint and register it (repeatable)")
    parser.add_argument("--replicas", type=int, default=1, metavar="K", help=(
        "policy servers per checkpoint (default 1): K replicas on consecutive ports, registered as one policy "
        "whose episodes the workers spread over them"))
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="policy-server engine (default vllm)")
    parser.add_argument("--workers", type=int, default=1, help="Celery worker processes (default 1)")
    parser.add_argument("--concurrency", type=int, help="episodes at once per worker (default: CPU cores)")
    parser.add_argument("--host", default="127.0.0.1", help="API bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="API port (default 8080)")
    parser.add_argument("--policy-port", type=int, default=8000, help="first policy-server port (default 8000)")
    parser.add_argument("--run-dir", default="runs/stack", help="logs, stack.json, api-key (default runs/stack)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the stack to be up")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds a process gets to stop before SIGKILL")
    add_log_level(parser, "of the supervisor's own log (the children log to RUN_DIR/logs)")


def run(args: argparse.Namespace) -> int:
    from services.stack import Stack

    if args.workers < 0:
        print(f"evalforge up: --workers must be 0 or more, got {args.workers}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print(f"evalforge up: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print(f"evalforge up: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "alembic"):  # one line per health check or migration step is noise here
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return Stack(args).up()
