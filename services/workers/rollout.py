"""The rollout command: evaluate a policy checkpoint on a suite, sequentially, in one process.

    evalforge rollout --checkpoint DIR --suite SUITE --episodes-per-task N [--policy-server URL]
    trainer rollout ...                      (the same command: `trainer` hands over to this module)
    python -m services.workers.rollout ...

Episodes run one after another in this process against a policy server: the one
at ``--policy-server``, or one this command starts on the checkpoint (vLLM engine
by default) and stops at the end. Each episode uses evaluation seeds
(``benchmarks.suite.evaluation_seed``), never a demonstration seed, and the same
loop as the distributed workers (``benchmarks.runner.run_episode``) with an
action-chunk broker. Prints the per-task success table; ``--json`` also writes it.
This is the sequential reference the distributed evaluation is measured against.

It needs no database or broker: only the policy client and the launcher that runs
``policy-server`` as a subprocess (both in ``services.protocol``), and the suites.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.registry import get_suite
from benchmarks.runner import EpisodeOutcome, run_episode
from benchmarks.suite import SuiteError, evaluation_seed
from services.protocol.client import ActionChunkBroker, PolicyClient
from services.protocol.launcher import PolicyServerProcess

# The name the user typed, when another command hands over to this module (`trainer rollout`).
PROG_ENV = "EVALFORGE_PROG"


class PolicyMismatch(ValueError):
    """The policy's dimensions or task tokens do not fit the suite it is to be evaluated on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(prog=parser.prog)  # errors name the command as the user typed it
    parser.add_argument("--checkpoint", type=Path, help="policy checkpoint to serve (when no --policy-server)")
    parser.add_argument("--suite", required=True, help="benchmark suite, e.g. metaworld-mt1-reach")
    parser.add_argument("--episodes-per-task", type=int, required=True, metavar="N")
    parser.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    parser.add_argument("--policy-server", metavar="URL", help="ws://host:port/ws of a running policy server")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="engine of the server started here")
    parser.add_argument("--max-steps", type=int, help="override the suite's step limit per episode")
    parser.add_argument("--first-episode", type=int, default=0,
                        help="index of the first evaluation seed (episode i uses evaluation_seed(first + i))")
    parser.add_argument("--json", type=Path, help="also write per-episode results and the table here")


def _check_policy_fits_suite(client: PolicyClient, suite_name: str, tasks: list[str]) -> None:
    suite = get_suite(suite_name)
    meta = client.metadata
    problems = []
    if meta.state_dim != suite.state_dim or meta.action_dim != suite.action_dim:
        problems.append(f"dims state {meta.state_dim}/action {meta.action_dim}, the suite has "
                        f"{suite.state_dim}/{suite.action_dim}")
    missing = [t for t in tasks if t not in meta.tasks]
    if missing:
        problems.append(f"no task token for {', '.join(missing)}")
    if problems:
        raise PolicyMismatch(f"policy {meta.policy_name!r} does not fit suite {suite_name}: {'; '.join(problems)}")


def rollout(url: str, suite_name: str, tasks: list[str], episodes_per_task: int, *,
            max_steps: int | None = None, first_episode: int = 0) -> list[dict]:
    """Play every (task, evaluation seed) episode in order; one result dict per episode.

    Raises ``PolicyMismatch`` before the first episode if the policy at ``url`` does not fit the suite.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    suite = get_suite(suite_name)
    results: list[dict] = []
    with PolicyClient(url) as client, Progress(TextColumn("{task.description}"), BarColumn(),
                                               MofNCompleteColumn(), TimeRemainingColumn()) as progress:
        _check_policy_fits_suite(client, suite_name, tasks)
        bar = progress.add_task("episodes", total=len(tasks) * episodes_per_task)
        for task in tasks:
            env = suite.make_env(task, evaluation_seed(first_episode))
            if max_steps is not None:
                env.max_steps = max_steps
            try:
                for i in range(episodes_per_task):
                    seed = evaluation_seed(first_episode + i)
                    episode_id = f"rollout-{task}-{seed}"
                    broker = ActionChunkBroker(client, episode_id=episode_id)
                    progress.update(bar, description=f"{task} seed {seed}")
                    outcome: EpisodeOutcome = run_episode(env, lambda obs, b=broker: b.act(obs), seed=seed)
                    latencies = np.asarray(broker.latencies_s) * 1e3
                    results.append({**asdict(outcome), "inferences": len(latencies),
                                    "latency_mean_ms": float(latencies.mean()) if len(latencies) else 0.0,
                                    "latency_p95_ms": float(np.percentile(latencies, 95)) if len(latencies) else 0.0})
                    progress.advance(bar)
            finally:
                env.close()
    return results


def summarize(results: list[dict]) -> list[dict]:
    """Per-task rows (and an overall row): episodes, success rate, mean steps, latencies."""
    rows = []
    groups = {task: [r for r in results if r["task"] == task] for task in dict.fromkeys(r["task"] for r in results)}
    groups["all"] = results
    for task, episodes in groups.items():
        if not episodes:
            continue
        rows.append({
            "task": task,
            "episodes": len(episodes),
            "successes": sum(r["success"] for r in episodes),
            "success_rate": sum(r["success"] for r in episodes) / len(episodes),
            "mean_steps": float(np.mean([r["steps"] for r in episodes])),
            "latency_mean_ms": float(np.mean([r["latency_mean_ms"] for r in episodes])),
            "episode_s": float(np.mean([r["duration_s"] for r in episodes])),
        })
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    try:
        suite = get_suite(args.suite)
        tasks = [suite.task(t.strip()).name for t in args.tasks.split(",")] if args.tasks else suite.task_names
    except SuiteError as exc:
        raise SystemExit(f"{args.prog}: {exc}") from None
    if args.episodes_per_task < 1:
        raise SystemExit(f"{args.prog}: --episodes-per-task must be at least 1")
    if args.policy_server is None and args.checkpoint is None:
        raise SystemExit(f"{args.prog}: give --checkpoint (a server is started on it) or --policy-server URL")

    server = None
    if not args.policy_server:
        server = PolicyServerProcess(args.checkpoint, "--engine", args.engine, "--engine-core", "compute",
                                     log_dir=args.checkpoint)  # the simulator runs on this host too
        try:
            server.start()
        except RuntimeError as exc:
            raise SystemExit(f"{args.prog}: could not start a policy server on {args.checkpoint}: {exc}") from None
    started = time.perf_counter()
    try:
        results = rollout(args.policy_server or server.ws_url, args.suite, tasks, args.episodes_per_task,
                          max_steps=args.max_steps, first_episode=args.first_episode)
    except PolicyMismatch as exc:
        raise SystemExit(f"{args.prog}: {exc}") from None
    finally:
        if server is not None:
            server.stop()
    elapsed = time.perf_counter() - started
    rows = summarize(results)

    table = Table(title=f"{args.suite}: {len(results)} episodes in {elapsed:.0f} s "
                        f"({len(results) / elapsed * 60:.1f} episodes/min)")
    for column in ("task", "episodes", "success", "mean steps", "policy ms (mean)", "s / episode"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for row in rows:
        table.add_row(row["task"], str(row["episodes"]), f"{row['success_rate']:.0%} ({row['successes']})",
                      f"{row['mean_steps']:.0f}", f"{row['latency_mean_ms']:.1f}", f"{row['episode_s']:.2f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"suite": args.suite, "elapsed_s": elapsed, "summary": rows,
                                         "episodes": results}, indent=2))
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m services.workers.rollout ...``; ``trainer rollout`` execs this with ``EVALFORGE_PROG`` set."""
    parser = argparse.ArgumentParser(prog=os.environ.pop(PROG_ENV, "python -m services.workers.rollout"),
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
