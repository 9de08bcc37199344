"""Serve the evaluation API with uvicorn, on the store at DATABASE_URL.

The database schema must be current (`evalforge db upgrade`), or pass --migrate to
upgrade it first.
"""

from __future__ import annotations

import argparse
import sys

from services.cli import add_log_level

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # uvicorn's own, "critical" too


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--migrate", action="store_true", help="upgrade the database schema first")
    add_log_level(parser, choices=UVICORN_LOG_LEVELS)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from services.store import migrate

    if args.migrate:
        migrate.upgrade()
    else:
        try:
            migrate.check_current()
        except migrate.SchemaNotCurrent as exc:
            print(f"evalforge api: {exc} (or start with `evalforge api --migrate`)", file=sys.stderr)
            return 2
    uvicorn.run("services.eval_api.app:create_app", factory=True, host=args.host, port=args.port,
                log_level=args.log_level, proxy_headers=False)
    return 0
