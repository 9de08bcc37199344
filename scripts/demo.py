"""`make demo`: the main job end to end on embedded defaults.

1. collect scripted-expert demonstrations on MetaWorld reach (``trainer collect-demos``);
2. train the fast behaviour-cloning recipe (``trainer vla --config configs/vla-reach-fast.yaml``),
   which exports the policy checkpoint (Hugging Face weights + ``policy.json``);
3. start the stack (``evalforge up``: eval API, worker, sweeper and a vLLM policy server
   for the checkpoint, on SQLite and the embedded broker), which registers the policy;
4. submit an evaluation through the REST API and show its progress live;
5. print the per-task results and the suite's leaderboard, both read back from the
   API (so from the database), then stop the stack.

Each stage prints its wall time when it ends, and the last line all of them.

Everything lives under ``runs/`` (demos, the training run, the stack's logs and the
SQLite store); a second run reuses the demonstrations and the trained policy, and adds
one more evaluation to the same database. Options make every step smaller for a quick
check (the test suite runs it that way):

    .venv/bin/python scripts/demo.py [--episodes-per-task 20] [--demos 400] [--train-steps N]
                                     [--engine vllm|hf] [--root runs] [--keep-running]

``--vision`` runs the same five stages for a vision-language-action policy on
``metaworld-mt1-reach-pixels`` (the goal is only in the images): demonstrations with the
``corner`` camera's frames (``--image-size``, default 32), ``configs/vla-reach-pixels.yaml``
at demo size (``VISION_DEMO_OVERRIDES`` below: patches of a quarter of the side, so 16 image
rows as in the recipe, batch 32, ``--train-steps`` default 200 instead of 1500), the vLLM
server encoding the frames, and an evaluation that renders the corner camera at the size
the policy was trained on:

    .venv/bin/python scripts/demo.py --vision [--demos 30] [--train-steps 200] [--image-size 32]
                                     [--episodes-per-task 4]

A policy that small, trained that briefly, is not expected to reach the goal (the full
recipe is not there yet either: docs/benchmarks.md, "Vision recipe on MetaWorld
reach-pixels"); its numbers show the pipeline works, not what vision policies can do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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

VISION_SUITE = "metaworld-mt1-reach-pixels"
VISION_RECIPE = ROOT / "configs" / "vla-reach-pixels.yaml"
VISION_POLICY_NAME = "reach-pixels-demo"
VISION_CAMERA = "corner"
VISION_DEFAULTS = {"demos": 30, "train_steps": 200, "episodes_per_task": 4, "image_size": 32}
# configs/vla-reach-pixels.yaml at demo size; vision.image_size and vision.patch_size (a quarter
# of the side: 16 image rows per frame, as in the recipe) follow --image-size, and the schedule
# --train-steps. No intermediate checkpoints: a demo run is short enough to redo.
VISION_DEMO_OVERRIDES = ["--training.micro_batch_size", "32", "--training.global_batch_size", "32",
                         "--checkpoint.save_every", "0", "--logging.log_every", "25"]
VISION_CAVEAT = ("A demo-sized vision policy (a few dozen demonstrations, a few hundred steps, small frames) "
                 "is not expected to reach the goal: these numbers show the pipeline works end to end, not "
                 "what the recipe can do (docs/benchmarks.md, \"Vision recipe on MetaWorld reach-pixels\").")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT / "runs",
                        help="where demos, the training run, the stack and the store go (default runs/)")
    parser.add_argument("--vision", action="store_true",
                        help=f"the vision pipeline instead: {VISION_SUITE} with the {VISION_CAMERA} camera, "
                             f"{VISION_RECIPE.relative_to(ROOT)} at demo size")
    parser.add_argument("--demos", type=int, help="expert demonstrations to collect "
                        f"(default 400; --vision: {VISION_DEFAULTS['demos']})")
    parser.add_argument("--train-steps", type=int, help="training steps "
                        f"(default: the recipe's; --vision: {VISION_DEFAULTS['train_steps']})")
    parser.add_argument("--episodes-per-task", type=int, help="evaluation episodes "
                        f"(default 20; --vision: {VISION_DEFAULTS['episodes_per_task']})")
    parser.add_argument("--image-size", type=int, help="--vision: side of the camera frames, in demonstrations, "
                        f"training and evaluation (a multiple of 4, at least 16; default {VISION_DEFAULTS['image_size']})")
    parser.add_argument("--max-steps", type=int, help="step limit per evaluation episode (default: the task's)")
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="policy-server engine")
    parser.add_argument("--workers", type=int, default=1, help="Celery worker processes (default 1)")
    parser.add_argument("--port", type=int, default=8080, help="API port (default 8080)")
    parser.add_argument("--policy-port", type=int, default=8000, help="policy-server port (default 8000)")
    parser.add_argument("--keep-running", action="store_true", help="leave the stack up at the end (Ctrl-C stops it)")
    args = parser.parse_args(argv)
    if args.image_size is not None and not args.vision:
        parser.error("--image-size sizes the camera frames of --vision; the state demo renders none")
    if args.vision:
        for name, default in VISION_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        if args.image_size < 16 or args.image_size % 4:
            parser.error(f"--image-size {args.image_size}: use a multiple of 4 of at least 16 (the patches are a "
                         "quarter of the side; cameras render 16 pixels a side or more)")
    else:
        args.demos = 400 if args.demos is None else args.demos
        args.episodes_per_task = 20 if args.episodes_per_task is None else args.episodes_per_task
    return args


@dataclass(frozen=True)
class DemoPlan:
    """What one run of the demo does, decided from its options before anything runs."""

    title: str
    suite: str
    policy_name: str
    demos: Path
    run_dir: Path
    collect_command: list[str]
    train_command: list[str]
    training: str
    """What stage 2 trains, for its progress line."""
    cameras: dict[str, tuple[int, int]] | None
    """The cameras the evaluation renders (``POST /evaluations``' ``cameras``); ``None``: state only."""
    tags: list[str]
    caveat: str | None = None

    @property
    def policy(self) -> Path:
        return self.run_dir / "policy"


def plan(args: argparse.Namespace) -> DemoPlan:
    """The state demo's plan (``make demo``), or the vision demo's with ``--vision``."""
    steps = args.train_steps
    if args.vision:
        size = args.image_size
        demos = args.root / "demos" / f"reach-pixels-{args.demos}-{VISION_CAMERA}{size}"
        run_dir = args.root / f"vla-reach-pixels-demo-{args.demos}x{size}px-{steps}steps"
        collect = [*_collect(VISION_SUITE, args.demos), "--cameras", VISION_CAMERA, "--image-size", str(size)]
        train = [*_train(VISION_RECIPE), *VISION_DEMO_OVERRIDES, "--vision.cameras", VISION_CAMERA,
                  "--vision.image_size", str(size), "--vision.patch_size", str(size // 4)]
        return DemoPlan(
            title="EvalForge vision demo: train a reach-pixels VLA policy on camera frames, serve it with vLLM, "
                  "evaluate it through the API",
            suite=VISION_SUITE, policy_name=VISION_POLICY_NAME, demos=demos, run_dir=run_dir,
            collect_command=collect + ["--out", str(demos)],
            train_command=train + _schedule(steps) + ["--run_dir", str(run_dir), "--data.path", str(demos)],
            training=f"{VISION_RECIPE.relative_to(ROOT)} at demo size ({VISION_CAMERA} {size}×{size}, patch "
                     f"{size // 4}, {steps} steps at batch 32)",
            cameras={VISION_CAMERA: (size, size)}, tags=["demo", "vision"], caveat=VISION_CAVEAT)
    demos = args.root / "demos" / f"reach-{args.demos}"
    run_dir = args.root / ("vla-reach-fast" if not steps else f"vla-reach-{steps}steps")
    collect = _collect(SUITE, args.demos)
    train = _train(RECIPE)
    return DemoPlan(
        title="EvalForge demo: train a reach policy, serve it, evaluate it through the API",
        suite=SUITE, policy_name=POLICY_NAME, demos=demos, run_dir=run_dir,
        collect_command=collect + ["--out", str(demos)],
        train_command=train + ["--run_dir", str(run_dir), "--data.path", str(demos)] + _schedule(steps),
        training=str(RECIPE.relative_to(ROOT)), cameras=None, tags=["demo"])


def _collect(suite: str, episodes: int) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "collect-demos", "--suite", suite, "--episodes-per-task", str(episodes)]


def _train(recipe: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", "vla", "--config", str(recipe), "--resume", "auto"]


def _schedule(steps: int | None) -> list[str]:
    if not steps:
        return []
    return ["--schedule.train_steps", str(steps), "--schedule.warmup_steps", str(max(1, steps // 20))]


class StageClock:
    """The wall time of each stage: one line as a stage ends, all of them in :meth:`summary`."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        yield
        self.seconds[name] = time.monotonic() - started
        self.console.print(f"      {name}: {self.seconds[name]:.0f} s")

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.seconds.items())


def run_step(console: Console, command: list[str], what: str) -> None:
    """Run one pipeline command in the foreground, so its own progress bars show; stop the demo if it fails."""
    console.print(f"[dim]$ {' '.join(command)}[/dim]")
    code = subprocess.call(command, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"demo: {what} failed (exit {code}); the command was: {' '.join(command)}")


def collect_demos(console: Console, args: argparse.Namespace, demo: DemoPlan) -> None:
    if (demo.demos / "meta" / "info.json").is_file():
        console.print(f"[1/5] demonstrations: reusing {demo.demos}")
        return
    frames = f", with {VISION_CAMERA}-camera frames" if demo.cameras else ""
    console.print(f"[1/5] demonstrations: {args.demos} scripted-expert episodes of {demo.suite}{frames} → {demo.demos}")
    run_step(console, demo.collect_command, "collecting demonstrations")


def train(console: Console, demo: DemoPlan) -> Path:
    if (demo.policy / "policy.json").is_file():
        console.print(f"[2/5] training: reusing the policy in {demo.policy}")
        return demo.policy
    console.print(f"[2/5] training {demo.training} on {demo.demos} → {demo.policy}")
    run_step(console, demo.train_command, "training")
    if not (demo.policy / "policy.json").is_file():
        raise SystemExit(f"demo: training finished but exported no policy to {demo.policy}")
    return demo.policy


class StackProcess:
    """``evalforge up`` in the background (a ``ChildProcess``), its output in ``RUN_DIR/up.log``."""

    def __init__(self, args: argparse.Namespace, policy_name: str, policy: Path, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.state_file = run_dir / "stack.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "services.cli", "up", "--checkpoint", f"{policy_name}={policy}",
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
    demo = plan(args)
    console = Console(soft_wrap=True)  # long paths and commands stay on one line in a log, not cut at 80 columns
    console.rule(demo.title)
    if demo.caveat:
        console.print(demo.caveat)
    started = time.monotonic()
    clock = StageClock(console)

    with clock.stage("demonstrations"):
        collect_demos(console, args, demo)
    with clock.stage("training"):
        policy = train(console, demo)
    console.print(f"[3/5] stack: evalforge up --checkpoint {demo.policy_name}={policy} ({args.engine} engine)")
    stack = None
    try:
        with clock.stage("stack start"):
            stack = StackProcess(args, demo.policy_name, policy, args.root / "demo" / "stack")
            state = stack.wait_ready(console)
        api_key = (Path(state["api_key_file"])).read_text().strip()
        client = EvalForgeClient(state["api_url"], api_key)
        policy_id = state["policies"][0]["id"]
        console.print(f"      API {state['api_url']} (docs at /docs); policy {demo.policy_name} registered as id "
                      f"{policy_id}; store {state['database_url']}")

        cameras = "".join(f", {name} camera {h}×{w}" for name, (h, w) in (demo.cameras or {}).items())
        console.print(f"[4/5] evaluation: POST /evaluations — {demo.suite}, {args.episodes_per_task} episodes per "
                      f"task on held-out seeds{cameras}")
        with clock.stage("evaluation"):
            evaluation = client.submit_evaluation(policy_id, demo.suite, args.episodes_per_task,
                                                  max_steps=args.max_steps, cameras=demo.cameras, tags=demo.tags)
            detail = watch_with_progress(client, evaluation.id, console=console, poll_s=0.5)

        console.print(f"[5/5] results of evaluation {detail.id} (GET /evaluations/{detail.id}):")
        print_results(detail, console)
        board = client.leaderboard(demo.suite, include_nonstandard=args.max_steps is not None)
        console.print(f"Leaderboard for {demo.suite} (GET /leaderboard?suite={demo.suite}, from the database):")
        print_leaderboard(board, console)
        if demo.caveat:
            console.print(demo.caveat)
        console.print(f"Demo finished in {time.monotonic() - started:.0f} s ({clock.summary()}). The stack's logs: "
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
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    sys.exit(main())
