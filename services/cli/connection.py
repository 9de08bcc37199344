"""What the API-client verbs (``policy``, ``eval``, ``leaderboard``) share: options, errors, exit codes.

    evalforge policy register --name N --endpoint ws://HOST:PORT/ws [--version V]
    evalforge policy list
    evalforge eval submit --policy ID|NAME|NAME:VERSION --suite S --episodes-per-task N [--watch]
    evalforge eval status ID [--watch]
    evalforge eval list [--policy P] [--suite S] [--status S] [--tag T] [--limit N]
    evalforge eval cancel ID
    evalforge eval compare A B
    evalforge eval export ID --format csv|jsonl|parquet [--out FILE]
    evalforge eval rerun ID [--watch]
    evalforge eval dataset ID --out DIR
    evalforge leaderboard --suite S [--include-nonstandard]

Every verb takes ``--api-url`` (default ``$EVALFORGE_API_URL``, else
``http://127.0.0.1:8080``) and ``--api-key`` (default ``$EVALFORGE_API_KEY``;
writes need one). ``--json`` prints the API's JSON instead of tables, for scripts.
Exit codes: 0 done, 1 the API refused or could not be reached, 2 bad usage. These
verbs are thin clients of the REST API (``services/client.py``) and import neither
the web stack nor the store; building their parsers does not load httpx or rich.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a verb runs: building the parser must not load httpx and rich
    from services.client import EvalForgeClient

Handler = Callable[[argparse.Namespace, "EvalForgeClient"], int]


def client_verb(handler: Handler) -> Callable[[argparse.Namespace], int]:
    """Run ``handler`` with a client from ``--api-url``/``--api-key``; API errors are exit 1, usage errors 2."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from services.client import ApiRequestError, EvalForgeClient, WatchTimeout

        verb = f"evalforge {args.command}" + (f" {args.action}" if getattr(args, "action", None) else "")
        try:
            check_api_url(args.api_url or os.environ.get("EVALFORGE_API_URL", ""))
            client = EvalForgeClient(args.api_url, args.api_key, timeout_s=args.timeout_s)
        except ValueError as exc:
            print(f"{verb}: {exc}", file=sys.stderr)
            return 2
        try:
            with client:
                return handler(args, client)
        except (ApiRequestError, WatchTimeout) as exc:
            print(f"{verb}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{verb}: interrupted; evaluations go on on the server", file=sys.stderr)
            return 130

    return run


def check_api_url(url: str) -> None:
    """``ValueError`` naming the URL and the fix when an http(s) ``url`` has a malformed host or port
    (``http://[::1`` used to end in httpx's traceback; the client itself refuses other schemes)."""
    from urllib.parse import urlsplit

    url = url.strip()
    if not url.startswith(("http://", "https://")):
        return
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
        ok = bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"API URL {url!r} is not an http(s) URL with a valid host and port; pass one like "
                         "http://127.0.0.1:8080 or http://[::1]:8080 (--api-url or EVALFORGE_API_URL)")


def _positive(text: str, number: type[int] | type[float], noun: str, least: str) -> int | float:
    """``text`` as a ``number`` above 0, or an argparse error naming the input and the bound."""
    try:
        value = number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int(_positive(text, int, "a whole number", "at least 1"))


def positive_float(text: str) -> float:
    return float(_positive(text, float, "a number", "more than 0"))


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """``--api-url``, ``--api-key``, ``--timeout``."""
    group = parser.add_argument_group("API connection")
    group.add_argument("--api-url", metavar="URL",
                       help="the evaluation API (default: $EVALFORGE_API_URL, else http://127.0.0.1:8080)")
    group.add_argument("--api-key", metavar="KEY",
                       help="API key for writes, from `evalforge apikey create` (default: $EVALFORGE_API_KEY)")
    group.add_argument("--timeout", dest="timeout_s", type=positive_float, default=10.0, metavar="SECONDS",
                       help="per-request timeout (default: 10)")


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")


def add_watch_options(parser: argparse.ArgumentParser) -> None:
    """``--watch``, ``--poll``, ``--watch-timeout``."""
    parser.add_argument("--watch", action="store_true",
                        help="show a progress bar until the evaluation is done, then its results")
    parser.add_argument("--poll", dest="poll_s", type=positive_float, default=1.0, metavar="SECONDS",
                        help="with --watch: seconds between polls (default: 1)")
    parser.add_argument("--watch-timeout", dest="watch_timeout_s", type=positive_float, metavar="SECONDS",
                        help="with --watch: give up after this long (exit 1; the evaluation goes on)")
