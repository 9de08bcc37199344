"""ALOHA suites: build, reset and step cost of our environment against gym-aloha's own, with and
without the top camera, full-length episodes per minute per core, and the scripted expert's cost
and success rate.

For each suite two environments are built (timed): ours (``suite.make_env``) and gym-aloha's
``AlohaEnv(obs_type="pixels_agent_pos")``, which LeRobot evaluates with. Then ``--steps`` random
joint targets near the current pose are applied, step by step, each timed in wall and process CPU
seconds:

- ``raw physics step``: what gym-aloha's step computes before its observation (its task's
  ``before_step``, 10 physics substeps, ``get_reward``, ``get_qpos``) on our physics — the reference
  for the ≤ 1.1 × target;
- ``gym-aloha step``: gym-aloha's ``step``, which renders top, angle and front_close at 480 × 640;
- ``ours``: ``env.step`` (renders nothing);
- ``ours + top H×W``: ``env.step`` then ``env.render_images({"top": (H, W)})``.

Reset: ours (object poses from the seed, no rendering) and gym-aloha's (which renders its three
cameras). ``episodes/min/core`` is 60 / CPU seconds of one reset plus 400 steps: an episode that
runs to the step limit (a failing one: the slowest case). The expert rows: planning one seed (the
400-step mocap run that records the joint commands) and the success rate over ``--expert-seeds``
seeds. Cells are medians in ms; CPU is process time (Mesa's llvmpipe renders on several threads,
so CPU can exceed wall).

    .venv/bin/python bench/suites_aloha.py [--steps N] [--expert-seeds N] [--sizes 240x320,480x640]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from suites import Clock  # noqa: E402  (bench/suites.py)

from benchmarks import aloha as al  # noqa: E402  (sets MUJOCO_GL before MuJoCo loads)
from benchmarks.registry import get_suite  # noqa: E402
from benchmarks.runner import run_policy_episode  # noqa: E402

SUITES = {"aloha-transfer-cube": al.TRANSFER_CUBE, "aloha-insertion": al.INSERTION}


def measure(suite_name: str, steps: int, sizes: list[tuple[int, int]], expert_seeds: int
            ) -> list[tuple[str, float, float]]:
    suite = get_suite(suite_name)
    task = SUITES[suite_name]
    low, high = suite.action_low_array, suite.action_high_array
    build = Clock()
    ours = build.time(suite.make_env, task, 0)
    # Only now: gym-aloha imports dm_control, which loads Mesa; ours imported triton before it.
    from gym_aloha.env import AlohaEnv as GymAlohaEnv

    theirs = build.time(GymAlohaEnv, task.replace("-", "_"), "pixels_agent_pos")
    rows = [("build ours", build.wall[0] * 1e3, build.cpu[0] * 1e3),
            ("build gym-aloha", build.wall[1] * 1e3, build.cpu[1] * 1e3)]

    reset_ours, reset_theirs = Clock(), Clock()
    for seed in range(5):
        reset_ours.time(ours.reset, seed)
        reset_theirs.time(theirs.reset, seed)
    rows += [("reset ours", *reset_ours.ms()), ("reset gym-aloha (renders 3 cameras)", *reset_theirs.ms())]

    physics, sim_task = ours._physics, ours._sim_task

    def raw_physics_step(action: np.ndarray) -> None:
        sim_task.before_step(action, physics)
        physics.step(ours._substeps)
        sim_task.get_reward(physics)
        sim_task.get_qpos(physics)

    def ours_with(action: np.ndarray, cameras: dict[str, tuple[int, int]]) -> None:
        ours.step(action)
        ours.render_images(cameras)

    clocks = {"raw physics step": Clock(), "gym-aloha step (3 cameras 480×640)": Clock(), "ours": Clock()}
    clocks |= {f"ours + top {h}×{w}": Clock() for h, w in sizes}
    rng = np.random.default_rng(0)

    def actions(n: int):
        state = ours.reset(0)["state"]
        for _ in range(n):
            if ours._done:
                ours.reset()
            yield np.clip(state + rng.normal(0, 0.05, 14), low, high).astype(np.float32)
            state = ours.expert_observation()["state"]

    # Steps without cameras first, on their own: a render in between leaves the caches cold for
    # whatever runs next. Which of the two goes first alternates.
    for step, action in enumerate(actions(5 * steps)):
        pair = [("ours", ours.step, action), ("raw physics step", raw_physics_step, action.astype(np.float64))]
        for name, fn, arg in pair[::1 if step % 2 else -1]:
            clocks[name].time(fn, arg)
    for step, action in enumerate(actions(steps)):
        if step < 20:  # ~0.2 s a step: a few are enough for a median
            clocks["gym-aloha step (3 cameras 480×640)"].time(theirs.step, action.astype(np.float64))
        for h, w in sizes:
            if ours._done:
                ours.reset()
            clocks[f"ours + top {h}×{w}"].time(ours_with, action, {"top": (h, w)})
    rows += [(name, *clock.ms()) for name, clock in clocks.items()]

    reset_cpu = reset_ours.ms()[1]
    for name in ("ours", *(f"ours + top {h}×{w}" for h, w in sizes)):
        cpu_ms = reset_cpu + al.MAX_STEPS * clocks[name].ms()[1]
        rows.append((f"episodes/min/core ({name}, {al.MAX_STEPS} steps)", 60e3 / cpu_ms, float("nan")))
    rows.append(("ours / raw physics step (wall)", clocks["ours"].ms()[0] / clocks["raw physics step"].ms()[0],
                 float("nan")))

    expert = suite.expert(task)
    plan = Clock()
    for seed in range(3):
        plan.time(expert.joint_commands, al._initial_object_pose(task, seed))
    rows.append(("expert: plan one seed (400-step mocap run)", *plan.ms()))
    successes, lengths = 0, []
    for seed in range(expert_seeds):
        outcome = run_policy_episode(ours, lambda _obs: expert(ours.expert_observation()), seed=seed)
        successes += outcome.success
        lengths.append(outcome.steps)
    rows.append((f"expert: successes over seeds 0..{expert_seeds - 1}", successes, float("nan")))
    rows.append(("expert: mean episode length (steps)", float(np.mean(lengths)), float("nan")))
    ours.close()
    theirs.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--expert-seeds", type=int, default=30)
    parser.add_argument("--sizes", default="240x320,224x224,480x640")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    print(f"# ALOHA suites ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}, {args.steps} steps)")
    for suite_name in SUITES:
        rows = measure(suite_name, args.steps, sizes, args.expert_seeds)
        print(f"\n## {suite_name}\n")
        print("| what | wall ms | CPU ms |\n|---|---:|---:|")
        for name, wall, cpu in rows:
            if np.isnan(cpu):
                print(f"| {name} | {wall:.3g} | |")
            else:
                print(f"| {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
