"""Create, list and revoke API keys in the store at DATABASE_URL.

A key is stored hashed: `create` prints it once, and it cannot be shown again.

Each key has a scope: `submit` (the default: register policies, submit evaluations,
change and cancel its own), `read` (reads only, for when the API sets
EVALFORGE_READS_NEED_KEY) or `admin` (everything, other keys' policies and
evaluations included).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="apikey_command", required=True, metavar="ACTION")
    create_parser = actions.add_parser("create", help="create a key and print it (only this once)")
    create_parser.add_argument("--name", required=True, help="who or what uses the key")
    create_parser.add_argument("--scope", choices=("read", "submit", "admin"), default="submit",
                               help="what the key may do: read; submit (default: register policies, submit and "
                               "cancel its own evaluations); admin (everything)")
    actions.add_parser("list", help="list keys")
    revoke_parser = actions.add_parser("revoke", help="revoke a key")
    revoke_parser.add_argument("id", type=int, help="the key's id (`evalforge apikey list`)")


def run(args: argparse.Namespace) -> int:
    return {"create": create, "list": list_keys, "revoke": revoke}[args.apikey_command](args)


def _store_session() -> AbstractContextManager[Session]:
    """A session on ``DATABASE_URL``, once the schema is known to be current."""
    from services.store.db import create_db_engine, make_session_factory, session_scope
    from services.store.migrate import check_current

    check_current()
    return session_scope(make_session_factory(create_db_engine()))


def create(args: argparse.Namespace) -> int:
    from services.store.api_keys import create_api_key

    with _store_session() as session:
        row, plaintext = create_api_key(session, args.name, args.scope)
        print(f"created API key {row.id} named {row.name!r} with scope {args.scope}; it is shown only this once, "
              "store it now:")
        print(plaintext)
    return 0


def list_keys(args: argparse.Namespace) -> int:
    from services.store.api_keys import list_api_keys

    with _store_session() as session:
        rows = list_api_keys(session)
        if not rows:
            print("no API keys; create one with `evalforge apikey create --name NAME`")
            return 0
        print(f"{'id':>5}  {'prefix':<14} {'state':<8} {'scopes':<13} {'created (UTC)':<20} name")
        for row in rows:
            state = "revoked" if row.revoked_at else "active"
            print(f"{row.id:>5}  {row.prefix + '…':<14} {state:<8} {row.scopes:<13} "
                  f"{row.created_at:%Y-%m-%d %H:%M:%S}  {row.name}")
    return 0


def revoke(args: argparse.Namespace) -> int:
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
