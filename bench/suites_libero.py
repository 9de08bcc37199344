"""LIBERO suites: build, reset and step cost of our environment against the raw LIBERO env, with and
without cameras, and full-length episodes per minute per core.

For each suite's first task, three environments are built (timed): ours (``suite.make_env``), the
raw ``OffScreenRenderEnv`` without camera observations (the physics step our step wraps) and the
raw env as openpi's LIBERO example builds it (camera observations of agentview and wrist at the
size asked, rendered inside every step). Then ``--steps`` random actions are applied, the
environments interleaved step by step, each step timed in wall and process CPU seconds:

- ``raw step``: the raw env's ``step`` without cameras — the reference;
- ``ours``: ``env.step`` without cameras (target: ≤ 1.1 × raw step);
- ``ours + 2 cams N²``: ``env.step`` then ``env.render_images`` of agentview and wrist at N × N;
- ``raw cams N²``: the raw env's ``step`` with its camera observations at N × N.

Reset: ours (in place, set_init_state, 10 settle steps) and openpi's (LIBERO's default hard reset,
which rebuilds the simulation, then set_init_state and 10 settle steps). Cells are medians in ms;
CPU is process time (Mesa's llvmpipe renders on several threads, so CPU can exceed wall).
``episodes/min/core`` is 60 / CPU seconds of one reset plus ``max_steps`` steps: an episode that
runs to the step limit (a failing one: the slowest case).

    .venv/bin/python bench/suites_libero.py [--steps N] [--suites libero-spatial,...] [--sizes 128,224]
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

from benchmarks import libero as lb  # noqa: E402  (sets MUJOCO_GL before MuJoCo loads)
from benchmarks.registry import get_suite  # noqa: E402


def raw_env(suite_name: str, task: str, camera_size: int | None):
    from libero.libero import get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    bddl = os.path.join(get_libero_path("bddl_files"), lb.SUITES[suite_name][0], f"{task}.bddl")
    if camera_size is None:
        return OffScreenRenderEnv(bddl_file_name=bddl, use_camera_obs=False, ignore_done=True)
    return OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=camera_size, camera_widths=camera_size,
                              ignore_done=True)


def raw_reset(env, init_state: np.ndarray) -> None:
    env.reset()
    env.set_init_state(init_state)
    for _ in range(lb.SETTLE_STEPS):
        env.step(lb.SETTLE_ACTION)


def measure(suite_name: str, steps: int, sizes: list[int]) -> list[tuple[str, float, float]]:
    suite = get_suite(suite_name)
    task = suite.tasks[0].name
    rows: list[tuple[str, float, float]] = []
    build = Clock()
    ours = build.time(suite.make_env, task, 0)
    raw = build.time(raw_env, suite_name, task, None)
    raw_cams = {size: build.time(raw_env, suite_name, task, size) for size in sizes}
    rows += [("build ours", build.wall[0] * 1e3, build.cpu[0] * 1e3),
             ("build raw (no cameras)", build.wall[1] * 1e3, build.cpu[1] * 1e3)]

    init_state = ours._init_states[0]
    reset_ours, reset_raw = Clock(), Clock()
    for seed in range(3):
        reset_ours.time(ours.reset, seed)
        reset_raw.time(raw_reset, raw_cams[sizes[-1]], init_state)
    raw_reset(raw, init_state)
    for env in list(raw_cams.values())[:-1]:
        raw_reset(env, init_state)
    rows += [("reset ours (in place)", *reset_ours.ms()), ("reset openpi-style (hard)", *reset_raw.ms())]

    rng = np.random.default_rng(0)
    clocks = {"raw step": Clock(), "ours": Clock()}
    for size in sizes:
        clocks[f"ours + 2 cams {size}²"] = Clock()
        clocks[f"raw cams {size}²"] = Clock()

    def ours_with(cameras):
        result = ours.step(action)
        ours.render_images(cameras)
        return result

    for _ in range(steps):
        action = rng.uniform(-1, 1, 7).astype(np.float32)
        if ours._done:
            ours.reset()
        clocks["raw step"].time(raw.step, action.astype(np.float64))
        clocks["ours"].time(ours.step, action)
        for size in sizes:
            if ours._done:
                ours.reset()
            clocks[f"ours + 2 cams {size}²"].time(ours_with, {"agentview": (size, size), "wrist": (size, size)})
            clocks[f"raw cams {size}²"].time(raw_cams[size].step, action.astype(np.float64))
    rows += [(name, *clock.ms()) for name, clock in clocks.items()]

    max_steps = suite.tasks[0].max_steps
    reset_cpu = reset_ours.ms()[1]
    for name in ("ours", *(f"ours + 2 cams {size}²" for size in sizes)):
        cpu_ms = reset_cpu + max_steps * clocks[name].ms()[1]
        rows.append((f"episodes/min/core ({name}, {max_steps} steps)", 60e3 / cpu_ms, float("nan")))
    for i, clock_kind in enumerate(("wall", "CPU")):
        ratio = clocks["ours"].ms()[i] / clocks["raw step"].ms()[i]
        rows.append((f"ours / raw step ({clock_kind})", ratio, float("nan")))
    ours.close()
    raw.close()
    for env in raw_cams.values():
        env.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--suites", default=",".join(lb.SUITES))
    parser.add_argument("--sizes", default="128,224")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# LIBERO suites ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"MUJOCO_GL={os.environ.get('MUJOCO_GL')}, {args.steps} steps, first task of each suite)")
    for suite_name in args.suites.split(","):
        rows = measure(suite_name, args.steps, sizes)
        print(f"\n## {suite_name} ({get_suite(suite_name).tasks[0].name})\n")
        print("| what | wall ms | CPU ms |\n|---|---:|---:|")
        for name, wall, cpu in rows:
            if name.startswith(("episodes", "ours / raw")):
                print(f"| {name} | {wall:.2f} | |")
            else:
                print(f"| {name} | {wall:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
