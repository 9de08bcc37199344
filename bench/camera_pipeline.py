"""What showing a policy two cameras costs an evaluation: episodes/min with and without frames.

    .venv/bin/python bench/camera_pipeline.py [--episodes 6] [--max-steps 100] [--sizes 96,224]

One image-blind policy (a state-only reach checkpoint from ``trainer init-policy``: it
ignores images, so its actions, and the episodes, are the same on every path) behind
one real ``policy-server --engine hf``; the worker's own episode path
(``run_policy_episode`` + ``ActionChunkBroker`` + ``services.workers.cameras.observing_policy``)
plays MetaWorld reach episodes on evaluation seeds:

- **state only**: no cameras (nothing rendered, nothing sent but the state);
- **2 cameras at S px**: ``corner`` and ``gripper`` at S×S rendered at every inference
  step (MuJoCo offscreen, EGL/llvmpipe on a CPU host), encoded, sent and decoded by the
  server, as a vision policy would get them.

The paths take turns episode by episode on the same seeds (a change in the load of a
shared machine hits all alike). Prints episodes/min, ms per step, ms per inference,
and the slowdown against state only.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.registry import get_suite  # noqa: E402
from benchmarks.runner import run_policy_episode  # noqa: E402
from benchmarks.suite import evaluation_seed  # noqa: E402
from services.protocol.client import ActionChunkBroker, PolicyClient  # noqa: E402
from services.supervisor import PolicyServerProcess  # noqa: E402
from services.workers.cameras import observing_policy  # noqa: E402
from trainer.cli import main as trainer_main  # noqa: E402

SUITE, TASK = "metaworld-mt1-reach", "reach-v3"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=6, help="episodes per path (default: 6)")
    parser.add_argument("--max-steps", type=int, default=100, help="steps per episode (default: 100)")
    parser.add_argument("--sizes", default="96,224", help="camera sizes in px, comma-separated (default: 96,224)")
    args = parser.parse_args(argv)
    paths = {"state only": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        paths[f"2 cameras at {size} px"] = {"corner": (size, size), "gripper": (size, size)}

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "policy"
        trainer_main(["init-policy", "--suite", SUITE, "--out", str(checkpoint), "--force"])
        server = PolicyServerProcess(checkpoint, "--engine", "hf", log_dir=Path(tmp)).start(180)
        try:
            figures = _measure(server.ws_url, paths, args.episodes, args.max_steps)
        finally:
            server.stop()

    base = figures["state only"]
    print(f"MetaWorld {TASK}, {args.episodes} episodes × {args.max_steps} steps per path, image-blind hf policy "
          f"(chunk 4); {platform.node()}, {platform.processor() or platform.machine()}")
    print(f"{'path':<22} {'episodes/min':>12} {'ms/step':>8} {'ms/inference':>12} {'vs state only':>13} "
          f"{'per-episode ratio: median [min, max]':>38}")
    for name, (walls, steps, inferences) in figures.items():
        wall = sum(walls)
        ratios = [w / b for w, b in zip(walls, base[0], strict=True)]
        print(f"{name:<22} {60 * args.episodes / wall:>12.1f} {1e3 * wall / steps:>8.2f} "
              f"{1e3 * wall / inferences:>12.1f} {wall / sum(base[0]):>12.2f}× "
              f"{statistics.median(ratios):>20.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")
    return 0


def _measure(url: str, paths: dict[str, dict], episodes: int,
             max_steps: int) -> dict[str, tuple[list[float], int, int]]:
    """Per path: each timed episode's wall seconds, total steps, total inferences."""
    suite = get_suite(SUITE)
    walls: dict[str, list[float]] = {name: [] for name in paths}
    totals = {name: [0, 0] for name in paths}
    with PolicyClient(url) as client, suite.make_env(TASK, evaluation_seed(0)) as env:
        env.max_steps = max_steps
        for i in range(-1, episodes):  # episode -1: untimed warm-up of every path
            seed = evaluation_seed(10_000 if i < 0 else i)
            for name, cameras in paths.items():
                broker = ActionChunkBroker(client, episode_id=f"bench-{name}-{seed}")
                started = time.perf_counter()
                outcome = run_policy_episode(env, observing_policy(env, broker, cameras), seed=seed)
                wall = time.perf_counter() - started
                if i >= 0:
                    walls[name].append(wall)
                    totals[name][0] += outcome.steps
                    totals[name][1] += broker.inferences
    steps = {totals[name][0] for name in paths}
    if len(steps) != 1:
        print(f"warning: the paths played different numbers of steps ({sorted(steps)}): the policy is not "
              "image-blind", file=sys.stderr)
    return {name: (walls[name], steps_, inferences) for name, (steps_, inferences) in totals.items()}


if __name__ == "__main__":
    raise SystemExit(main())
