"""``evalforge``: the command line of the evaluation services.

    evalforge api [--host 127.0.0.1] [--port 8080] [--migrate]   serve the evaluation API
    evalforge apikey create --name NAME                           print a new API key (once)
    evalforge apikey list                                         list keys (prefix, name, state)
    evalforge apikey revoke ID                                    revoke a key
    evalforge db upgrade [REVISION] | downgrade REVISION | current
    evalforge worker [--concurrency N] [--loglevel info]         run episodes from the `episodes` queue
    evalforge sweeper [--once]                                    re-enqueue stranded episodes (a loop)
    evalforge rollout --suite SUITE --episodes-per-task N ...     evaluate a policy sequentially (no store)
    evalforge policy register|list                                register / list policies (via the API)
    evalforge eval submit|status|list|cancel                      run and follow evaluations (via the API)
    evalforge leaderboard --suite SUITE                           policies ranked on a suite (via the API)
    evalforge up [--checkpoint [NAME=]DIR ...] [--workers N]      the whole stack, supervised (services/stack.py)

Every verb reads the store from ``DATABASE_URL`` (default: the SQLite file
``./runs/evalforge.db``). Each verb imports only what it needs, so ``evalforge
apikey list`` does not load the web stack. Later verbs (``worker``, ``up``,
``eval …``) plug in as further subparsers. The API-client verbs (``policy``, ``eval``,
``leaderboard``: ``--api-url``/``--api-key``) live in ``services/client_cli.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from services.client_cli import add_client_verbs

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


def _cmd_api(args: argparse.Namespace) -> int:
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


def _store_session() -> AbstractContextManager[Session]:
    """A session on ``DATABASE_URL``, once the schema is known to be current."""
    from services.store.db import make_engine, make_session_factory, session_scope
    from services.store.migrate import check_current

    check_current()
    return session_scope(make_session_factory(make_engine()))


def _cmd_apikey_create(args: argparse.Namespace) -> int:
    from services.store.api_keys import create_api_key

    with _store_session() as session:
        row, plaintext = create_api_key(session, args.name)
        print(f"created API key {row.id} named {row.name!r}; it is shown only this once, store it now:")
        print(plaintext)
    return 0


def _cmd_apikey_list(args: argparse.Namespace) -> int:
    from services.store.api_keys import list_api_keys

    with _store_session() as session:
        rows = list_api_keys(session)
        if not rows:
            print("no API keys; create one with `evalforge apikey create --name NAME`")
            return 0
        print(f"{'id':>5}  {'prefix':<14} {'state':<8} {'created (UTC)':<20} name")
        for row in rows:
            state = "revoked" if row.revoked_at else "active"
            print(f"{row.id:>5}  {row.prefix + '…':<14} {state:<8} {row.created_at:%Y-%m-%d %H:%M:%S}  {row.name}")
    return 0


def _cmd_apikey_revoke(args: argparse.Namespace) -> int:
    from services.store.api_keys import revoke_api_key
    from services.store.queries import NotFound

    with _store_session() as session:
        try:
            row = revoke_api_key(session, args.id)
        except NotFound as exc:
            print(f"evalforge apikey revoke: {exc}", file=sys.stderr)
            return 1
        print(f"revoked API key {row.id} ({row.prefix}…, {row.name!r})")
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    from services.store import migrate
    from services.store.db import make_engine

    if args.db_command == "upgrade":
        migrate.upgrade(revision=args.revision)
    elif args.db_command == "downgrade":
        migrate.downgrade(revision=args.revision)
    engine = make_engine()
    try:
        current = migrate.current_revision(engine)
    finally:
        engine.dispose()
    print(f"database {engine.url.render_as_string(hide_password=True)} is at migration {current or '(empty)'}; "
          f"newest is {migrate.head_revision()}")
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    import os
    import socket

    from services.workers.celery_app import app
    from services.workers.settings import settings

    concurrency = args.concurrency or os.cpu_count() or 1
    if concurrency < 1:
        print(f"evalforge worker: --concurrency must be at least 1, got {concurrency}", file=sys.stderr)
        return 2
    argv = ["worker", "--pool", "prefork", "--concurrency", str(concurrency), "--queues", settings.episode_queue,
            "--loglevel", args.loglevel, "--hostname", args.hostname or f"episodes-{os.getpid()}@{socket.gethostname()}",
            "--without-gossip", "--without-mingle"]
    app.worker_main(argv)
    return 0


def _cmd_sweeper(args: argparse.Namespace) -> int:
    import logging

    from services.store.migrate import check_current
    from services.workers.settings import settings
    from services.workers.sweeper import make_sweeper

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_current()
    sweeper = make_sweeper(settings)
    if args.once:
        report = sweeper.sweep_once()
        print(f"re-enqueued {len(report.reenqueued)} episodes; worker_lost in evaluations {report.lost}; "
              f"cancelled running episodes in {report.cancelled}; finalised {report.finalised}")
        return 0
    sweeper.run_forever()
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from services.workers import rollout

    rollout.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evalforge", description="EvalForge evaluation services.")
    verbs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    api = verbs.add_parser("api", help="serve the evaluation API with uvicorn")
    api.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    api.add_argument("--port", type=int, default=8080)
    api.add_argument("--migrate", action="store_true", help="upgrade the database schema first")
    api.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    api.set_defaults(handler=_cmd_api)

    apikey = verbs.add_parser("apikey", help="create, list and revoke API keys")
    apikey_verbs = apikey.add_subparsers(dest="apikey_command", required=True, metavar="ACTION")
    create = apikey_verbs.add_parser("create", help="create a key and print it (only this once)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.set_defaults(handler=_cmd_apikey_create)
    apikey_verbs.add_parser("list", help="list keys").set_defaults(handler=_cmd_apikey_list)
    revoke = apikey_verbs.add_parser("revoke", help="revoke a key")
    revoke.add_argument("id", type=int, help="the key's id (`evalforge apikey list`)")
    revoke.set_defaults(handler=_cmd_apikey_revoke)

    db = verbs.add_parser("db", help="database schema migrations (Alembic)")
    db_verbs = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_verbs.add_parser("upgrade", help="upgrade to REVISION (default: the newest)")
    upgrade.add_argument("revision", nargs="?", default="head")
    downgrade = db_verbs.add_parser("downgrade", help="downgrade to REVISION (e.g. -1, base)")
    downgrade.add_argument("revision")
    db_verbs.add_parser("current", help="show the database's migration")
    db.set_defaults(handler=_cmd_db)

    worker = verbs.add_parser("worker", help="run a Celery worker that plays episodes (prefork)")
    worker.add_argument("--concurrency", type=int, metavar="N",
                        help="episode processes (default: the number of CPU cores)")
    worker.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    worker.add_argument("--hostname", help="Celery node name (default: episodes-PID@HOST)")
    worker.set_defaults(handler=_cmd_worker)

    sweeper = verbs.add_parser("sweeper", help="re-enqueue pending/lost episodes, close dead ones (a loop)")
    sweeper.add_argument("--once", action="store_true", help="sweep once and exit")
    sweeper.set_defaults(handler=_cmd_sweeper)

    # Its flags; importing it loads numpy and the policy client, not the store or Celery.
    from services.workers import rollout as rollout_module

    rollout = verbs.add_parser("rollout", help="evaluate a policy checkpoint on a suite, sequentially, in this "
                               "process (the same command as `trainer rollout`)", description=rollout_module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    rollout_module.add_arguments(rollout)
    rollout.set_defaults(handler=_cmd_rollout)
    add_client_verbs(verbs)

    from services.stack import add_up_verb

    add_up_verb(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exception as exc:
        from services.store.migrate import SchemaNotCurrent

        if isinstance(exc, SchemaNotCurrent):
            print(f"evalforge {args.command}: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
