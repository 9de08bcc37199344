"""The `trainer` command. Each verb is a module: `trainer init-policy` → trainer/init_policy.py.

A verb module has ``add_arguments(parser)`` and ``run(args)``. One that sets
``CONFIG_OVERRIDES = True`` also takes ``--section.key value`` config overrides after
its own options; they reach it as ``args.overrides`` (a list of strings).

A verb in ``HANDED_OVER`` is another package's command that `trainer` runs for
convenience: the process becomes ``python -m MODULE ARGS`` (os.execv), so the
training core imports nothing of ``services`` (DESIGN.md: `trainer` never imports
`services`). ``trainer rollout`` is ``evalforge rollout``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import warnings

VERBS = {
    "init-policy": ("trainer.init_policy", "write an untrained, random-initialised policy checkpoint"),
    "collect-demos": ("trainer.collect_demos", "run a suite's scripted expert and write a LeRobot v3 dataset"),
    "export": ("trainer.export", "write a training checkpoint as a Hugging Face model (config.json + safetensors)"),
    "tokenizer": ("trainer.tokenizer", "train a byte-level BPE tokenizer on jsonl corpora"),
    "preprocess": ("trainer.preprocess", "tokenize jsonl text into a Megatron indexed dataset (.bin/.idx)"),
    "pretrain": ("trainer.pretrain", "pretrain a GPT (dense or MoE) on megatron-core"),
    "vla": ("trainer.vla", "train a robot policy on LeRobot demonstrations and export it for policy-server"),
    "sft": ("trainer.sft", "fine-tune a GPT on chat data (alpaca, sharegpt, OpenAI messages)"),
}

# verb → (module run as `python -m`, help, the command it is, the extras it needs)
HANDED_OVER = {
    "rollout": ("services.cli.rollout",
                "evaluate a policy checkpoint on a suite, sequentially, against a policy server",
                "evalforge rollout", "services,sim"),
}


def hand_over(verb: str, argv: list[str]) -> int:
    """Replace this process by ``python -m MODULE argv``; returns (2) only if the module is not installed.

    So it never returns to a caller that runs ``main(["rollout", ...])`` in-process: tests run the command.
    """
    module, _, command, extras = HANDED_OVER[verb]
    try:
        # Imports the parent packages (services/__init__.py, services/workers/__init__.py: docstrings only).
        installed = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        installed = False
    if not installed:
        print(f"trainer {verb}: needs the {' and '.join(extras.split(','))} extras ({module} is not "
              f"installed here): pip install 'evalforge[{extras}]'. `{command}` is the same command.",
              file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    # The module's usage and errors then say `trainer rollout`, the command the user typed.
    os.environ["EVALFORGE_PROG"] = f"trainer {verb}"
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


LOG_LEVELS = ["debug", "info", "warning", "error"]


def quiet_known_warnings() -> None:
    """Filter, once for every verb, what megatron-core and its dependencies print on a CPU host that no
    user can act on: the notes that Transformer Engine and Apex are not installed (torch is then used,
    which is this host's expected path)."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex).*(not installed|not found)")
    warnings.filterwarnings("ignore", message=r".*fused.*(Apex|apex|Transformer Engine).*")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in HANDED_OVER:
        return hand_over(argv[0], argv[1:])
    quiet_known_warnings()
    parser = argparse.ArgumentParser(prog="trainer", description="EvalForge training core.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="log messages of this level and above (default: info)")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    # Only the chosen verb's module is imported: most verbs need no torch or megatron,
    # and `trainer --help` should not wait for them.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for verb, (module_name, help_text) in VERBS.items():
        if verb != chosen:
            verbs.add_parser(verb, help=help_text, parents=[common])
            continue
        module = importlib.import_module(module_name)
        sub = verbs.add_parser(verb, help=help_text, description=module.__doc__, parents=[common],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, takes_overrides=getattr(module, "CONFIG_OVERRIDES", False))
    for verb, (_, help_text, command, _) in HANDED_OVER.items():
        verbs.add_parser(verb, help=f"{help_text} (the same as `{command}`)", add_help=False)
    args, extra = parser.parse_known_args(argv)
    if args.verb in HANDED_OVER:  # after an unknown option (`trainer --x rollout`): the module refuses it
        return hand_over(args.verb, extra)
    if extra and not args.takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    # Libraries (megatron-core logs every parallel-state step at INFO) speak from warning up unless debugging.
    level = args.log_level.upper()
    logging.basicConfig(level=level if level == "DEBUG" else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(level)
    args.run(args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
