"""Render cost per step per camera, against the simulator's own step, at 64/96/128/224 px.

For each camera (MetaWorld ``corner`` and ``gripper`` on reach-v3, both together, PushT ``top``) and each
square size, one environment plays ``--steps`` steps of random in-bounds actions (a new
episode when one ends); every step is timed twice, interleaved: ``env.step(action)`` and
then ``env.render_images({camera: (size, size), ...})`` of the state it reached, which is what a
worker does at each step its policy looks. Cells are the median and the interquartile
range (IQR) over the steps, in milliseconds; ``render/step`` is the ratio of the medians.
``first frame`` is the first render at that size, which makes the renderer (for MuJoCo an
OpenGL context and its offscreen buffer) and is paid once per size per environment.

    .venv/bin/python bench/render_cost.py [--steps N] [--sizes 64,96,128,224]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.registry import get_suite  # noqa: E402  (sets MUJOCO_GL before MuJoCo loads)

CAMERAS = [("metaworld-mt1-reach", "reach-v3", ("corner",)),
           ("metaworld-mt1-reach", "reach-v3", ("gripper",)),
           ("metaworld-mt1-reach", "reach-v3", ("corner", "gripper")),
           ("pusht", "push-t", ("top",))]


def median_iqr_ms(seconds: list[float]) -> tuple[float, float]:
    q1, median, q3 = np.percentile(np.asarray(seconds) * 1e3, [25, 50, 75])
    return float(median), float(q3 - q1)


def measure(suite_name: str, task: str, camera_names: tuple[str, ...], size: int, steps: int) -> dict[str, float]:
    suite = get_suite(suite_name)
    rng = np.random.default_rng(0)
    cameras = {camera: (size, size) for camera in camera_names}
    step_s, render_s = [], []
    with suite.make_env(task, seed=0) as env:
        env.reset()
        start = time.perf_counter()
        env.render_images(cameras)
        first_s = time.perf_counter() - start
        for _ in range(steps):
            action = rng.uniform(suite.action_low_array, suite.action_high_array).astype(np.float32)
            start = time.perf_counter()
            result = env.step(action)
            step_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            env.render_images(cameras)
            render_s.append(time.perf_counter() - start)
            if result.done:
                env.reset()
    step_median, step_iqr = median_iqr_ms(step_s)
    render_median, render_iqr = median_iqr_ms(render_s)
    return {"step": step_median, "step_iqr": step_iqr, "render": render_median, "render_iqr": render_iqr,
            "ratio": render_median / step_median, "first": first_s * 1e3}


def gl_renderer() -> str:
    """The OpenGL renderer MuJoCo draws with (e.g. Mesa's llvmpipe), or why it is unknown."""
    try:
        suite = get_suite("metaworld-mt1-reach")
        with suite.make_env("reach-v3") as env:
            env.reset()
            env.render_images({"corner": (16, 16)})
            from OpenGL import GL

            return GL.glGetString(GL.GL_RENDERER).decode()
    except Exception as exc:  # only a label for the table
        return f"unknown ({type(exc).__name__})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per camera and size (default 200)")
    parser.add_argument("--sizes", default="64,96,128,224", help="comma-separated square sizes in pixels")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    renderer = gl_renderer()  # first: importing the MetaWorld suites settles MUJOCO_GL
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"MUJOCO_GL={os.environ.get('MUJOCO_GL', '(unset)')}, OpenGL renderer: {renderer}")
    print(f"{args.steps} steps per row, random in-bounds actions; median (IQR) in ms\n")
    header = ("suite", "camera", "size", "step ms", "render ms", "render/step", "first frame ms")
    rows = []
    for suite_name, task, camera_names in CAMERAS:
        for size in sizes:
            m = measure(suite_name, task, camera_names, size, args.steps)
            rows.append((suite_name, "+".join(camera_names), f"{size}x{size}", f"{m['step']:.3f} ({m['step_iqr']:.3f})",
                         f"{m['render']:.3f} ({m['render_iqr']:.3f})", f"{m['ratio']:.1f}x", f"{m['first']:.0f}"))
            print("  ".join(rows[-1]), file=sys.stderr, flush=True)  # progress
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
