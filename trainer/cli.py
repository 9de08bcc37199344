"""The `trainer` command. Each verb is a module: `trainer init-policy` → trainer/init_policy.py."""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "init-policy": ("trainer.init_policy", "write an untrained, random-initialised policy checkpoint"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer", description="EvalForge training core.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        module = importlib.import_module(module_name)
        sub = verbs.add_parser(verb, help=help_text, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
