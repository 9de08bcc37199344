"""`make demo`: the main job end to end on embedded defaults.

1. collect scripted-expert demonstrations on MetaWorld reach (``trainer collect-demos``);
2. train the fast behaviour-cloning recipe (``trainer vla --config configs/vla-reach-fast.yaml``),
   which exports the policy checkpoint (Hugging Face weights + ``policy.json``);
3. start the stack (``evalforge up``: eval API, worker, sweeper and a vLLM policy server
   for the checkpoint, on SQLite and the embedded broker), which registers the policy;
4. submit an evaluation through the REST API and show its progress live;
5. print the per-task results and the suite's leaderboard, both read back from the
   API (so from the database), then stop the stack.

Everything lives under ``runs/`` (demos, the training run, the stack's logs and the
SQLite store); a second run reuses the demonstrations and the trained policy, and adds
one more evaluation to the same database. Options make every step smaller for a quick
check (the test suite runs it that way):

    .venv/bin/python scripts/demo.py [--episodes-per-task 20] [--demos 400] [--train-steps N]
                                     [--engine vllm|hf] [--root runs] [--keep-running]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli.render import print_leaderboard, print_results, watch_with_progress  # noqa: E402
from services.client import EvalForgeClient  # noqa: E402
from services.supervisor import ChildProcess, StartupError  # noqa: E402

SUITE = "metaworld-mt1-reach"
RECIPE = ROOT / "configs" / "vla-reach-fast.yaml"
POLICY_NAME = "reach-bc-fast"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT / "runs",
                        help="where demos, the training run, the stack and the store go (default runs/)")
    parser.add_argument("--demos", type=int, default=400, help="expert demonstrations to collect (default 400)")
    parser.add_argument("--train-steps", type=int, help="training steps (default: the recipe's)")
    parser.add_argument("--episodes-per-task", type=int, default=20, help="evaluation episodes (default 20)")
    parser.add_argument("--max-steps", type=int, help="step limit per evaluation episode (default: the task's)")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="policy-server engine")
    parser.add_argument("--workers", type=int, default=1, help="Celery worker processes (default 1)")
    parser.add_argument("--port", type=int, default=8080, help="API port (default 8080)")
    parser.add_argument("--policy-port", type=int, default=8000, help="policy-server port (default 8000)")
    parser.add_argument("--keep-running", action="store_true", help="leave the stack up at the end (Ctrl-C stops it)")
    return parser.parse_args(argv)


def run_step(console: Console, command: list[str], what: str) -> None:
    """Run one pipeline command in the foreground, so its own progress bars show; stop the demo if it fails."""
    console.print(f"[dim]$ {' '.join(command)}[/dim]")
    code = subprocess.call(command, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"demo: {what} failed (exit {code}); the command was: {' '.join(command)}")


def collect_demos(console: Console, args: argparse.Namespace, demos: Path) -> None:
    if (demos / "meta" / "info.json").is_file():
        console.print(f"[1/5] demonstrations: reusing {demos}")
        return
    console.print(f"[1/5] demonstrations: {args.demos} scripted-expert episodes of {SUITE} → {demos}")
    run_step(console, [sys.executable, "-m", "trainer.cli", "collect-demos", "--suite", SUITE,
                       "--episodes-per-task", str(args.demos), "--out", str(demos)], "collecting demonstrations")


def train(console: Console, args: argparse.Namespace, demos: Path, run_dir: Path) -> Path:
    policy = run_dir / "policy"
    if (policy / "policy.json").is_file():
        console.print(f"[2/5] training: reusing the policy in {policy}")
        return policy
    console.print(f"[2/5] training {RECIPE.relative_to(ROOT)} on {demos} → {policy}")
    command = [sys.executable, "-m", "trainer.cli", "vla", "--config", str(RECIPE), "--resume", "auto",
               "--run_dir", str(run_dir), "--data.path", str(demos)]
    if args.train_steps:
        command += ["--schedule.train_steps", str(args.train_steps),
                    "--schedule.warmup_steps", str(max(1, args.train_steps // 20))]
    run_step(console, command, "training")
    if not (policy / "policy.json").is_file():
        raise SystemExit(f"demo: training finished but exported no policy to {policy}")
    return policy


class StackProcess:
    """``evalforge up`` in the background (a ``ChildProcess``), its output in ``RUN_DIR/up.log``."""

    def __init__(self, args: argparse.Namespace, policy: Path, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.state_file = run_dir / "stack.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "services.cli", "up", "--checkpoint", f"{POLICY_NAME}={policy}",
                   "--engine", args.engine, "--workers", str(args.workers), "--run-dir", str(run_dir),
                   "--port", str(args.port), "--policy-port", str(args.policy_port)]
        env = {**os.environ, "DATABASE_URL": os.environ.get("DATABASE_URL")
               or f"sqlite:///{(args.root / 'evalforge.db').resolve()}"}
        # SIGTERM lets `evalforge up` stop its own children; the grace covers their drains.
        self.process = ChildProcess(command, run_dir / "up.log", health=self.ready, env=env, cwd=ROOT,
                                    grace_s=60, startup_timeout_s=900).start()

    def ready(self) -> bool:
        return self.state_file.is_file() and json.loads(self.state_file.read_text()).get("status") == "ready"

    def wait_ready(self, console: Console) -> dict:
        with console.status("starting the API, a worker, the sweeper and the policy server "
                            f"(logs in {self.run_dir / 'logs'})…"):
            try:
                self.process.wait_healthy(poll_s=0.5)
            except StartupError as exc:
                raise SystemExit(f"demo: the stack did not come up: {exc}") from None
        return json.loads(self.state_file.read_text())

    def stop(self) -> int | None:
        return self.process.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.root = args.root.resolve()
    console = Console(soft_wrap=True)  # long paths and commands stay on one line in a log, not cut at 80 columns
    console.rule("EvalForge demo: train a reach policy, serve it, evaluate it through the API")
    started = time.monotonic()
    demos = args.root / "demos" / f"reach-{args.demos}"
    run_dir = args.root / ("vla-reach-fast" if not args.train_steps else f"vla-reach-{args.train_steps}steps")

    collect_demos(console, args, demos)
    policy = train(console, args, demos, run_dir)
    console.print(f"[3/5] stack: evalforge up --checkpoint {POLICY_NAME}={policy} ({args.engine} engine)")
    stack = StackProcess(args, policy, args.root / "demo" / "stack")
    try:
        state = stack.wait_ready(console)
        api_key = (Path(state["api_key_file"])).read_text().strip()
        client = EvalForgeClient(state["api_url"], api_key)
        policy_id = state["policies"][0]["id"]
        console.print(f"      API {state['api_url']} (docs at /docs); policy {POLICY_NAME} registered as id "
                      f"{policy_id}; store {state['database_url']}")

        console.print(f"[4/5] evaluation: POST /evaluations — {SUITE}, {args.episodes_per_task} episodes per task "
                      "on held-out seeds")
        evaluation = client.submit_evaluation(policy_id, SUITE, args.episodes_per_task, max_steps=args.max_steps,
                                              tags=["demo"])
        detail = watch_with_progress(client, evaluation.id, console=console, poll_s=0.5)

        console.print(f"[5/5] results of evaluation {detail.id} (GET /evaluations/{detail.id}):")
        print_results(detail, console)
        board = client.leaderboard(SUITE, include_nonstandard=args.max_steps is not None)
        console.print(f"Leaderboard for {SUITE} (GET /leaderboard?suite={SUITE}, from the database):")
        print_leaderboard(board, console)
        console.print(f"Demo finished in {time.monotonic() - started:.0f} s. The stack's logs: "
                      f"{stack.run_dir / 'logs'}; run it yourself with `evalforge up --checkpoint {policy}`.")
        if args.keep_running:
            console.print(f"The stack keeps running: source {stack.run_dir / 'stack.env'} and try "
                          "`evalforge eval list`; Ctrl-C stops it.")
            try:
                stack.process.proc.wait()
            except KeyboardInterrupt:
                pass
        return 0 if detail.status == "finished" else 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
