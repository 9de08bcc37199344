"""Database schema migrations (Alembic) of the store at DATABASE_URL.

Each action ends by printing the database's migration and the newest one.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = actions.add_parser("upgrade", help="upgrade to REVISION (default: the newest)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.add_argument("--api-key-file", type=Path, metavar="PATH",
                         help="then make sure the deployment's write key exists: $EVALFORGE_API_KEY if set "
                              "(registered when new), else the key in PATH if the store accepts it, else a new "
                              "one written to PATH (compose's migrate service does this)")
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
    if getattr(args, "api_key_file", None):
        from services.client import API_KEY_ENV

        return ensure_key(args.api_key_file, os.environ.get(API_KEY_ENV, "").strip() or None)
    return 0


def ensure_key(key_file: Path, key: str | None) -> int:
    from services.store.api_keys import ensure_api_key
    from services.store.db import create_db_engine, make_session_factory, session_scope

    engine = create_db_engine()
    try:
        with session_scope(make_session_factory(engine)) as session:
            ensure_api_key(session, key_file, f"deployment ({key_file})", key)
    except ValueError as exc:
        print(f"evalforge db upgrade: {exc}")
        return 2
    finally:
        engine.dispose()
    print("the deployment's write key: $EVALFORGE_API_KEY" if key else f"the deployment's write key is in {key_file}")
    return 0
