"""The `evalforge` command. Each verb is a module: `evalforge apikey` → services/cli/apikey.py.

    evalforge api [--host 127.0.0.1] [--port 8080] [--migrate]   serve the evaluation API
    evalforge apikey create --name NAME | list | revoke ID        API keys (a new key is printed once)
    evalforge db upgrade [REVISION] | downgrade REVISION | current
    evalforge worker [--concurrency N] [--log-level info]        run episodes from the `episodes` queue
    evalforge sweeper [--once]                                    re-enqueue stranded episodes (a loop)
    evalforge up [--checkpoint [NAME=]DIR ...] [--workers N]      the whole stack, supervised
    evalforge rollout --suite SUITE --episodes-per-task N ...     evaluate a policy sequentially (no store)
    evalforge policy register|list                                register / list policies (via the API)
    evalforge eval submit|status|list|cancel                      run and follow evaluations (via the API)
    evalforge leaderboard --suite SUITE                           policies ranked on a suite (via the API)

A verb module has ``add_arguments(parser)`` and ``run(args) -> int`` (the exit
status); its ``DESCRIPTION``, else its docstring, is the verb's ``--help`` description. Only the chosen verb's
module is imported, and each imports what it needs when it runs, so ``evalforge
apikey list`` loads neither the web stack nor Celery, and the API-client verbs
(``policy``, ``eval``, ``leaderboard``; ``services/cli/connection.py``) neither the
store. The service verbs read the store from ``DATABASE_URL`` (default: the SQLite
file ``./runs/evalforge.db``). Every command that logs takes ``--log-level``.
Tables are drawn by ``services/cli/render.py``. Documented in ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(parser: argparse.ArgumentParser, help_text: str = "logging level (default: info)",
                  choices: Sequence[str] = LOG_LEVELS) -> None:
    """``--log-level``, spelled the same on every verb that logs."""
    parser.add_argument("--log-level", default="info", choices=choices, help=help_text)


# verb → (module, help)
VERBS = {
    "api": ("services.cli.api", "serve the evaluation API with uvicorn"),
    "apikey": ("services.cli.apikey", "create, list and revoke API keys"),
    "db": ("services.cli.db", "database schema migrations (Alembic)"),
    "worker": ("services.cli.worker", "run a Celery worker that plays episodes (prefork)"),
    "sweeper": ("services.cli.sweeper", "re-enqueue pending/lost episodes, close dead ones (a loop)"),
    "rollout": ("services.cli.rollout", "evaluate a policy checkpoint on a suite, sequentially, in this process "
                "(the same command as `trainer rollout`)"),
    "eval": ("services.cli.evaluations", "submit, follow, list and cancel evaluations (via the API)"),
    "leaderboard": ("services.cli.leaderboard", "policies ranked on a suite (via the API)"),
    "policy": ("services.cli.policies", "register and list policies (via the API)"),
    "up": ("services.cli.up", "start the whole stack as supervised local processes (Ctrl-C stops it)"),
}


def build_parser(verbs: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the verbs in ``verbs`` (default: all) with their flags, the others by name and help only."""
    parser = argparse.ArgumentParser(prog="evalforge", description="EvalForge evaluation services.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for verb, (module_name, help_text) in VERBS.items():
        if verbs is not None and verb not in verbs:
            subparsers.add_parser(verb, help=help_text)
            continue
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(verb, help=help_text, description=getattr(module, "DESCRIPTION", module.__doc__),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser({chosen} if chosen in VERBS else ()).parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:
        from services.store.migrate import SchemaNotCurrent

        if isinstance(exc, SchemaNotCurrent):
            print(f"evalforge {args.command}: {exc}", file=sys.stderr)
            return 2
        raise
