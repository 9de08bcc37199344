"""A suite's leaderboard from the evaluation API: each policy's comparable episodes pooled, ranked.

Only standard evaluations (every task at the standard step limits, under the suite's current
definition) compete, unless --include-nonstandard; a policy's contributing evaluations are
pooled (docs/statistics.md says why not its best). Success rates carry their Wilson 95%
interval, and a policy not significantly different from the one above it is marked.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from services.cli.connection import (
    add_connection_options,
    add_json_option,
    client_verb,
    positive_int,
)

if TYPE_CHECKING:
    from services.client import EvalForgeClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt10")
    parser.add_argument("--include-nonstandard", action="store_true",
                        help="also rank evaluations of task subsets or lowered step limits")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="at most N policies (default: 100)")
    add_connection_options(parser)
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    return client_verb(show_leaderboard)(args)


def show_leaderboard(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json, print_leaderboard, stdout_console

    board = client.leaderboard(args.suite, include_nonstandard=args.include_nonstandard, limit=args.limit)
    if args.json:
        print_json(board)
    else:
        print_leaderboard(board, stdout_console())
    return 0
