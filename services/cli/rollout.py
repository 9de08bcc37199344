"""The rollout command: evaluate a policy checkpoint on a suite, sequentially, in one process.

    evalforge rollout --checkpoint DIR --suite SUITE --episodes-per-task N [--policy-server URL]
    evalforge rollout --expert --suite SUITE --episodes-per-task N   (the scripted expert, same seeds)
    trainer rollout ...                      (the same command: `trainer` hands over to this module)
    python -m services.cli.rollout ...

Episodes run one after another in this process against a policy server: the one
at ``--policy-server``, or one this command starts on the checkpoint (vLLM engine
by default) and stops at the end. Each episode uses evaluation seeds, never a
demonstration seed, and the same loop as the distributed workers
(``services/workers/rollout.py``). Prints the per-task table — success rate with
its Wilson 95% interval, computed as the evaluation API computes it (simulator
failures recorded, left out of the rate) — and ``--json`` also writes it. This is
the sequential reference the distributed evaluation is measured against.
``--expert`` plays the suite's scripted expert on the same seeds instead (no server):
the baseline a policy's per-task success is read against.

It needs no database or broker: only the policy client and the launcher that runs
``policy-server`` as a subprocess (both in ``services.protocol``), and the suites.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The name the user typed, when another command hands over to this module (`trainer rollout`).
PROG_ENV = "EVALFORGE_PROG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(prog=parser.prog)  # errors name the command as the user typed it
    parser.add_argument("--checkpoint", type=Path, help="policy checkpoint to serve (when no --policy-server)")
    parser.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt1-reach")
    parser.add_argument("--episodes-per-task", type=int, required=True, metavar="N")
    parser.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    parser.add_argument("--policy-server", metavar="URL", help="ws://host:port/ws of a running policy server")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="engine of the server started here")
    parser.add_argument("--expert", action="store_true",
                        help="play the suite's scripted expert instead of a policy (no server): the baseline "
                             "on the same evaluation seeds")
    parser.add_argument("--max-steps", type=int, help="override the suite's step limit per episode")
    parser.add_argument("--first-episode", type=int, default=0,
                        help="index of the first evaluation seed (episode i uses evaluation_seed(first + i))")
    parser.add_argument("--json", type=Path, help="also write per-episode results and the table here")


def _percent(rate: float | None) -> str:
    return "–" if rate is None else f"{100 * rate:.1f}%"


def print_summary(rows: list[dict], title: str) -> None:
    """The per-task table of ``services.workers.rollout.summarize`` rows, on stdout (never cut in a pipe)."""
    from rich.table import Table

    from services.cli.render import print_table, stdout_console

    table = Table(title=title)
    for column in ("task", "episodes", "success", "95% CI", "mean steps", "policy ms (p50)", "s / episode",
                   "failures"):
        table.add_column(column, justify="left" if column in ("task", "failures") else "right")
    for row in rows:
        ci, latency = row["ci95"], row["latency_ms"]
        table.add_row(row["task"], str(row["episodes"]),
                      f"{_percent(row['success_rate'])} ({row['succeeded']}/{row['scored']})",
                      "–" if ci is None else f"[{100 * ci['low']:.1f}, {100 * ci['high']:.1f}]",
                      "–" if row["mean_steps"] is None else f"{row['mean_steps']:.0f}",
                      "–" if latency is None or latency["p50"] is None else f"{latency['p50']:.1f}",
                      f"{row['episode_s']:.2f}",
                      ", ".join(f"{reason} {n}" for reason, n in row["failure_reasons"].items()))
    print_table(stdout_console(), table)


def run(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from benchmarks.registry import get_suite
    from benchmarks.suite import SuiteError
    from services.supervisor import PolicyServerProcess
    from services.workers.rollout import PolicyMismatch, expert_rollout, rollout, summarize

    try:
        suite = get_suite(args.suite)
        tasks = [suite.task(t.strip()).name for t in args.tasks.split(",")] if args.tasks else suite.task_names
        if args.expert:
            suite.expert(tasks[0])  # NoExpertError (a SuiteError) says why a suite has none
    except SuiteError as exc:
        raise SystemExit(f"{args.prog}: {exc}") from None
    if args.episodes_per_task < 1:
        raise SystemExit(f"{args.prog}: --episodes-per-task must be at least 1")
    if args.expert:
        if args.policy_server or args.checkpoint:
            raise SystemExit(f"{args.prog}: --expert plays the suite's scripted expert; leave out --checkpoint "
                             "and --policy-server")
    elif args.policy_server is None and args.checkpoint is None:
        raise SystemExit(f"{args.prog}: give --checkpoint (a server is started on it), --policy-server URL "
                         "or --expert")

    server = None
    if not args.policy_server and not args.expert:
        server = PolicyServerProcess(args.checkpoint, "--engine", args.engine, "--engine-core", "compute",
                                     log_dir=args.checkpoint)  # the simulator runs on this host too
        try:
            server.start()
        except RuntimeError as exc:
            raise SystemExit(f"{args.prog}: could not start a policy server on {args.checkpoint}: {exc}") from None
    started = time.perf_counter()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as progress:
            bar = progress.add_task("episodes", total=len(tasks) * args.episodes_per_task)
            begun: list[int] = []

            def on_episode(task: str, seed: int) -> None:
                if begun:
                    progress.advance(bar)
                begun.append(seed)
                progress.update(bar, description=f"{task} seed {seed}")

            if args.expert:
                results = expert_rollout(args.suite, tasks, args.episodes_per_task, max_steps=args.max_steps,
                                         first_episode=args.first_episode, on_episode=on_episode)
            else:
                results = rollout(args.policy_server or server.ws_url, args.suite, tasks, args.episodes_per_task,
                                  max_steps=args.max_steps, first_episode=args.first_episode,
                                  on_episode=on_episode)
            progress.update(bar, completed=len(results))
    except PolicyMismatch as exc:
        raise SystemExit(f"{args.prog}: {exc}") from None
    finally:
        if server is not None:
            server.stop()
    elapsed = time.perf_counter() - started
    rows = summarize(results, tasks)
    who = "the scripted expert, " if args.expert else ""
    print_summary(rows, f"{args.suite}: {who}{len(results)} episodes in {elapsed:.0f} s "
                        f"({len(results) / elapsed * 60:.1f} episodes/min)")
    if args.json:
        args.json.write_text(json.dumps({"suite": args.suite, "elapsed_s": elapsed, "summary": rows,
                                         "episodes": results}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.cli.rollout ...``; ``trainer rollout`` execs this with ``EVALFORGE_PROG`` set."""
    parser = argparse.ArgumentParser(prog=os.environ.pop(PROG_ENV, "python -m services.cli.rollout"),
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
