"""Database schema migrations (Alembic) of the store at DATABASE_URL.

Each action ends by printing the database's migration and the newest one.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="upgrade to REVISION (default: the newest)")
    upgrade.add_argument("revision", nargs="?", default="head")
    downgrade = actions.add_parser("downgrade", help="downgrade to REVISION (e.g. -1, base)")
    downgrade.add_argument("revision")
    actions.add_parser("current", help="show the database's migration")


def run(args: argparse.Namespace) -> int:
    from services.store import migrate
    from services.store.db import create_db_engine

    if args.db_command == "upgrade":
        migrate.upgrade(revision=args.revision)
    elif args.db_command == "downgrade":
        migrate.downgrade(revision=args.revision)
    engine = create_db_engine()
    try:
        current = migrate.current_revision(engine)
    finally:
        engine.dispose()
    print(f"database {engine.url.render_as_string(hide_password=True)} is at migration {current or '(empty)'}; "
          f"newest is {migrate.head_revision()}")
    return 0
