"""The user verbs of ``evalforge``: thin clients of the REST API (``services/client.py``).

    evalforge policy register --name N --endpoint ws://HOST:PORT/ws [--version V]
    evalforge policy list
    evalforge eval submit --policy ID|NAME|NAME:VERSION --suite S --episodes-per-task N [--watch]
    evalforge eval status ID [--watch]
    evalforge eval list [--policy P] [--suite S] [--status S] [--tag T] [--limit N]
    evalforge eval cancel ID
    evalforge leaderboard --suite S [--include-nonstandard]

Every verb takes ``--api-url`` (default ``$EVALFORGE_API_URL``, else
``http://127.0.0.1:8080``) and ``--api-key`` (default ``$EVALFORGE_API_KEY``;
writes need one). ``--json`` prints the API's JSON instead of tables, for scripts.
Exit codes: 0 done, 1 the API refused or could not be reached, 2 bad usage. These
verbs import neither the web stack nor the store. Documented in ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a verb runs: building the parser must not load httpx and rich
    from rich.console import Console

    from services.client import EvalForgeClient

EVALUATION_STATUSES = ("pending", "running", "finished", "cancelled", "failed")
Handler = Callable[[argparse.Namespace, "EvalForgeClient"], int]


def _stdout() -> Console:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # a pipe or a log: do not squeeze tables into 80 columns
        console = Console(highlight=False, width=160)
    return console


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _client_verb(handler: Handler) -> Callable[[argparse.Namespace], int]:
    """Run ``handler`` with a client from ``--api-url``/``--api-key``; API errors are exit 1, usage errors 2."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from services.client import ApiError, EvalForgeClient, WatchTimeout

        verb = f"evalforge {args.command}" + (f" {args.action}" if getattr(args, "action", None) else "")
        try:
            client = EvalForgeClient(args.api_url, args.api_key, timeout_s=args.timeout_s)
        except ValueError as exc:
            print(f"{verb}: {exc}", file=sys.stderr)
            return 2
        try:
            with client:
                return handler(args, client)
        except (ApiError, WatchTimeout) as exc:
            print(f"{verb}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{verb}: interrupted; evaluations go on on the server", file=sys.stderr)
            return 130

    return run


# ---------------------------------------------------------------------------- policy


def _policy_register(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.client import policy_label

    policy = client.register_policy(args.name, args.endpoint, args.version)
    if args.json:
        _print_json(policy)
        return 0
    print(f"policy {policy['id']}: {policy_label(policy)} (checkpoint {policy['checkpoint_sha256'][:12]}…) at "
          f"{policy['endpoint']}, {len(policy['tasks'])} tasks; evaluate it with `evalforge eval submit "
          f"--policy {policy['id']} --suite SUITE --episodes-per-task N`")
    return 0


def _policy_list(args: argparse.Namespace, client: EvalForgeClient) -> int:
    policies = client.list_policies()
    if args.json:
        _print_json(policies)
        return 0
    if not policies:
        print("no policies registered; register a policy server with `evalforge policy register --name NAME "
              "--endpoint ws://HOST:PORT/ws`")
        return 0
    from rich.table import Table

    table = Table()
    for column in ("id", "name", "version", "checkpoint", "tasks", "endpoint", "registered (UTC)"):
        table.add_column(column, justify="right" if column in ("id", "tasks") else "left")
    for p in policies:
        table.add_row(str(p["id"]), p["name"], p["version"], p["checkpoint_sha256"][:12], str(len(p["tasks"])),
                      p["endpoint"], p["created_at"][:16].replace("T", " "))
    _stdout().print(table)
    return 0


# ---------------------------------------------------------------------------- eval


def _print_status(detail: dict[str, Any]) -> None:
    from services.client import episodes_done, policy_label, print_results

    counts = ", ".join(f"{status} {n}" for status, n in detail["counts"].items() if n)
    print(f"evaluation {detail['id']}: {detail['status']} · policy {policy_label(detail['policy'])} "
          f"(id {detail['policy']['id']}) · {detail['suite']} · {episodes_done(detail)}/{detail['episodes_total']} "
          f"episodes done ({counts or 'none yet'})")
    if episodes_done(detail):
        print_results(detail, _stdout())


def _watch(args: argparse.Namespace, client: EvalForgeClient, evaluation_id: int) -> dict[str, Any]:
    return client.watch_evaluation(evaluation_id, poll_s=args.poll_s, timeout_s=args.watch_timeout_s)


def _eval_submit(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.client import policy_label, print_results

    policy = client.resolve_policy(args.policy)
    detail = client.submit_evaluation(policy["id"], args.suite, args.episodes_per_task, seed=args.seed,
                                      tasks=args.tasks, max_steps=args.max_steps, tags=args.tags,
                                      idempotency_key=args.idempotency_key)
    if not args.json:
        print(f"submitted evaluation {detail['id']}: {policy_label(detail['policy'])} on {detail['suite']}, "
              f"{detail['episodes_total']} episodes ({len(detail['tasks'])} tasks × {detail['episodes_per_task']})"
              + ("" if args.watch else f"; follow it with `evalforge eval status {detail['id']} --watch`"))
    if args.watch:
        detail = _watch(args, client, detail["id"])
        if not args.json:
            print_results(detail, _stdout())
    if args.json:
        _print_json(detail)
    return 0


def _eval_status(args: argparse.Namespace, client: EvalForgeClient) -> int:
    detail = _watch(args, client, args.id) if args.watch else client.get_evaluation(args.id)
    if args.json:
        _print_json(detail)
    else:
        _print_status(detail)
    return 0


def _eval_list(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.client import percent, policy_label

    policy_id = client.resolve_policy(args.policy)["id"] if args.policy is not None else None
    rows = client.list_evaluations(limit=args.limit, policy_id=policy_id, suite=args.suite, status=args.status,
                                   tag=args.tag)
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print("no evaluations match; submit one with `evalforge eval submit --policy P --suite S "
              "--episodes-per-task N`")
        return 0
    from rich.table import Table

    table = Table()
    for column in ("id", "policy", "suite", "status", "episodes", "success", "created (UTC)", "tags"):
        table.add_column(column, justify="right" if column in ("id", "episodes", "success") else "left")
    for e in rows:
        table.add_row(str(e["id"]), policy_label(e["policy"]), e["suite"] + ("" if e["standard"] else " (subset)"),
                      e["status"], str(e["episodes_total"]), percent(e["success_rate"]),
                      e["created_at"][:16].replace("T", " "), ", ".join(e["tags"]))
    _stdout().print(table)
    return 0


def _eval_cancel(args: argparse.Namespace, client: EvalForgeClient) -> int:
    detail = client.cancel_evaluation(args.id)
    if args.json:
        _print_json(detail)
        return 0
    print(f"evaluation {detail['id']} is {detail['status']}: {detail['counts'].get('cancelled', 0)} episodes "
          f"cancelled, {detail['counts'].get('running', 0)} still running finish first")
    return 0


# ---------------------------------------------------------------------------- leaderboard


def _leaderboard(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.client import print_leaderboard

    board = client.leaderboard(args.suite, include_nonstandard=args.include_nonstandard, limit=args.limit)
    if args.json:
        _print_json(board)
    else:
        print_leaderboard(board, _stdout())
    return 0


# ---------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def _connection_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("API connection")
    group.add_argument("--api-url", metavar="URL",
                       help="the evaluation API (default: $EVALFORGE_API_URL, else http://127.0.0.1:8080)")
    group.add_argument("--api-key", metavar="KEY",
                       help="API key for writes, from `evalforge apikey create` (default: $EVALFORGE_API_KEY)")
    group.add_argument("--timeout", dest="timeout_s", type=_positive_float, default=10.0, metavar="SECONDS",
                       help="per-request timeout (default: 10)")
    return options


def _json_option() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
    return options


def _watch_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--watch", action="store_true",
                         help="show a progress bar until the evaluation is done, then its results")
    options.add_argument("--poll", dest="poll_s", type=_positive_float, default=1.0, metavar="SECONDS",
                         help="with --watch: seconds between polls (default: 1)")
    options.add_argument("--watch-timeout", dest="watch_timeout_s", type=_positive_float, metavar="SECONDS",
                         help="with --watch: give up after this long (exit 1; the evaluation goes on)")
    return options


def add_client_verbs(verbs: argparse._SubParsersAction) -> None:
    """Add ``eval``, ``leaderboard`` and ``policy`` to the ``evalforge`` subparsers ``verbs``."""
    conn, as_json, watch = _connection_options(), _json_option(), _watch_options()

    evaluation = verbs.add_parser("eval", help="submit, follow, list and cancel evaluations (via the API)")
    eval_verbs = evaluation.add_subparsers(dest="action", required=True, metavar="ACTION")

    submit = eval_verbs.add_parser("submit", parents=[conn, as_json, watch], help="start an evaluation")
    submit.add_argument("--policy", required=True, metavar="ID|NAME|NAME:VERSION",
                        help="a registered policy (`evalforge policy list`)")
    submit.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt10 (GET /suites)")
    submit.add_argument("--episodes-per-task", required=True, type=_positive_int, metavar="N")
    submit.add_argument("--seed", type=int, default=0, help="first evaluation seed (default: 0)")
    submit.add_argument("--task", dest="tasks", action="append", metavar="TASK",
                        help="evaluate only this task (repeatable; default: every task of the suite)")
    submit.add_argument("--max-steps", type=_positive_int, metavar="N",
                        help="step limit per episode, at most each task's own (default: the task's)")
    submit.add_argument("--tag", dest="tags", action="append", metavar="TAG", help="a label (repeatable)")
    submit.add_argument("--idempotency-key", metavar="KEY",
                        help="retry-safe submission: the same key and request return the same evaluation")
    submit.set_defaults(handler=_client_verb(_eval_submit))

    status = eval_verbs.add_parser("status", parents=[conn, as_json, watch],
                                   help="an evaluation's status and results")
    status.add_argument("id", type=_positive_int, help="evaluation id (`evalforge eval list`)")
    status.set_defaults(handler=_client_verb(_eval_status))

    listing = eval_verbs.add_parser("list", parents=[conn, as_json], help="evaluations, newest first")
    listing.add_argument("--policy", metavar="ID|NAME|NAME:VERSION", help="only this policy's")
    listing.add_argument("--suite", help="only this suite's")
    listing.add_argument("--status", choices=EVALUATION_STATUSES, help="only those in this status")
    listing.add_argument("--tag", help="only those with this tag")
    listing.add_argument("--limit", type=_positive_int, default=20, metavar="N", help="at most N (default: 20)")
    listing.set_defaults(handler=_client_verb(_eval_list))

    cancel = eval_verbs.add_parser("cancel", parents=[conn, as_json], help="cancel an evaluation")
    cancel.add_argument("id", type=_positive_int, help="evaluation id")
    cancel.set_defaults(handler=_client_verb(_eval_cancel))

    board = verbs.add_parser("leaderboard", parents=[conn, as_json], help="policies ranked on a suite (via the API)")
    board.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt10")
    board.add_argument("--include-nonstandard", action="store_true",
                       help="also rank evaluations of task subsets or lowered step limits")
    board.add_argument("--limit", type=_positive_int, metavar="N", help="at most N policies (default: 100)")
    board.set_defaults(handler=_client_verb(_leaderboard))

    policy = verbs.add_parser("policy", help="register and list policies (via the API)")
    policy_verbs = policy.add_subparsers(dest="action", required=True, metavar="ACTION")
    register = policy_verbs.add_parser("register", parents=[conn, as_json],
                                       help="register a running policy server (the API reads its handshake)")
    register.add_argument("--name", required=True, help="policy name, e.g. metaworld-mt10-bc")
    register.add_argument("--endpoint", required=True, metavar="URL",
                          help="the policy server's WebSocket URL, e.g. ws://gpu-3:8000/ws")
    register.add_argument("--version", help="version label (default: the checkpoint sha256's first 12 digits)")
    register.set_defaults(handler=_client_verb(_policy_register))
    listing = policy_verbs.add_parser("list", parents=[conn, as_json], help="registered policies, newest first")
    listing.set_defaults(handler=_client_verb(_policy_list))

