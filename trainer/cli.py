"""The `trainer` command. Each verb is a module: `trainer init-policy` → trainer/init_policy.py.

A verb module has ``add_arguments(parser)`` and ``run(args)``. One that sets
``CONFIG_OVERRIDES = True`` also takes ``--section.key value`` config overrides after
its own options; they reach it as ``args.overrides`` (a list of strings).
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "init-policy": ("trainer.init_policy", "write an untrained, random-initialised policy checkpoint"),
    "collect-demos": ("trainer.collect_demos", "run a suite's scripted expert and write a LeRobot v3 dataset"),
    "export": ("trainer.export", "write a training checkpoint as a Hugging Face model (config.json + safetensors)"),
    "tokenizer": ("trainer.tokenizer", "train a byte-level BPE tokenizer on jsonl corpora"),
    "preprocess": ("trainer.preprocess", "tokenize jsonl text into a Megatron indexed dataset (.bin/.idx)"),
    "pretrain": ("trainer.pretrain", "pretrain a GPT (dense or MoE) on megatron-core"),
    "vla": ("trainer.vla", "train a robot policy on LeRobot demonstrations and export it for policy-server"),
    "sft": ("trainer.sft", "fine-tune a GPT on chat data (alpaca, sharegpt, OpenAI messages)"),
    "rollout": ("trainer.rollout", "evaluate a policy checkpoint on a suite, sequentially, against a policy server"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trainer", description="EvalForge training core.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    # Only the chosen verb's module is imported: most verbs need no torch or megatron,
    # and `trainer --help` should not wait for them.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for verb, (module_name, help_text) in VERBS.items():
        if verb != chosen:
            verbs.add_parser(verb, help=help_text)
            continue
        module = importlib.import_module(module_name)
        sub = verbs.add_parser(verb, help=help_text, description=module.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, takes_overrides=getattr(module, "CONFIG_OVERRIDES", False))
    args, extra = parser.parse_known_args(argv)
    if extra and not args.takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    args.run(args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
