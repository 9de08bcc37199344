"""What recording an evaluation episode costs a worker (``services/workers/recording.py``); prints a table.

    .venv/bin/python bench/recording_cost.py [--suite metaworld-mt1-reach] [--steps 150] [--episodes 3]

Plays ``--episodes`` episodes of the suite's first task with a constant (zero) action, as the
runner plays them (``benchmarks.runner.run_policy_episode``), without a recorder and with one —
state only, and with one camera at 96×96 and 224×224 — then times writing the recording (encoding
each camera as AV1 once, one encoder thread, and the .npz). No policy server: the figures are the
worker's own cost, to set beside the policy's latency. Outcomes are compared across variants (a
recording must not change them).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.registry import get_suite  # noqa: E402
from benchmarks.runner import run_policy_episode  # noqa: E402
from services.workers.recording import RolloutRecorder, save_recording  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="metaworld-mt1-reach")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--episodes", type=int, default=3)
    args = parser.parse_args()

    suite = get_suite(args.suite)
    task = suite.task_names[0]
    camera = suite.cameras[0].name
    env = suite.make_env(task, 1_000_000)
    env.max_steps = args.steps
    zero = np.zeros(suite.action_dim, dtype=np.float32)

    def policy(obs):
        return zero

    variants = {"not recorded": None, "recorded, state only": {}, f"recorded, {camera} 96×96": {camera: (96, 96)},
                f"recorded, {camera} 224×224": {camera: (224, 224)}}
    rows, outcomes = [], {}
    with tempfile.TemporaryDirectory() as root:
        for name, cameras in variants.items():
            play, write, sizes = [], [], []
            for i in range(args.episodes):
                recorder = None if cameras is None else RolloutRecorder(env, cameras)
                act = policy if recorder is None else recorder.wrap(policy)
                start = time.perf_counter()
                outcome = run_policy_episode(env, act, seed=1_000_000 + i)
                play.append(time.perf_counter() - start)
                outcomes.setdefault(i, set()).add((outcome.success, outcome.steps, round(outcome.total_reward, 9)))
                if recorder is not None:
                    start = time.perf_counter()
                    relative = save_recording(recorder, Path(root), evaluation_id=1, episode_index=i, seed=i,
                                              success=outcome.success)
                    write.append(time.perf_counter() - start)
                    sizes.append((Path(root) / relative).stat().st_size)
            rows.append((name, statistics.median(play), statistics.median(write) if write else None,
                         statistics.median(sizes) if sizes else None))
    assert all(len(seen) == 1 for seen in outcomes.values()), f"recording changed an outcome: {outcomes}"

    base = rows[0][1]
    print(f"\nRecording cost — {args.suite}/{task}, {args.steps} steps a episode, median of {args.episodes}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"MUJOCO_GL={os.environ.get('MUJOCO_GL', '(default)')}; outcomes identical across variants\n")
    print("| variant | play s | ms per step | vs not recorded | write s (encode + .npz) | file KiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, play_s, write_s, size in rows:
        print(f"| {name} | {play_s:.2f} | {1000 * play_s / args.steps:.2f} | {play_s / base:.2f}× | "
              f"{'—' if write_s is None else f'{write_s:.2f}'} | {'—' if size is None else f'{size / 1024:,.0f}'} |")


if __name__ == "__main__":
    main()
