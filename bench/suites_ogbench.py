"""OGBench suites: step and reset cost with and without the camera against OGBench's own step, and
episodes per minute per core; with --experts, the oracle expert's success rate per task.

    .venv/bin/python bench/suites_ogbench.py [--steps 300] [--experts 5]

One process, one core. "raw step" is ``OGBench env.step`` on the same simulator instance the
wrapper holds; "wrapper" is ``EpisodeEnv.step`` (clipping, observation dict); "+ camera" also
renders ``front`` at 64 × 64 every step. Episodes/min: a full-length episode (the suite's step
limit, random actions) plus its reset, without and with the camera.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.registry import get_suite
from benchmarks.runner import run_policy_episode

SUITES = ("ogbench-cube-single", "ogbench-scene", "ogbench-puzzle-3x3")


def _per_call(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def bench_suite(name: str, steps: int) -> dict[str, float]:
    suite = get_suite(name)
    env = suite.make_env("task1", 0)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(steps, 5)).astype(np.float32)
    camera = {"front": (64, 64)}
    env.reset(0)
    env.render_images(camera)  # make the renderer outside the timing
    raw = env._env  # the OGBench environment the wrapper holds

    def run(step) -> float:
        env.reset(0)
        it = iter(actions)
        return _per_call(lambda: step(next(it)), steps)

    env.max_steps = steps + 1  # keep stepping past the suite's limit: timing only
    out = {
        "raw step": run(lambda a: raw.step(a.astype(np.float64))),
        "wrapper step": run(env.step),
        "step + camera": run(lambda a: (env.step(a), env.render_images(camera))),
        "reset": _per_call(lambda: env.reset(0), 20),
        "reset + camera": _per_call(lambda: (env.reset(0), env.render_images(camera)), 20),
    }
    limit = suite.max_steps("task1")
    out["episodes/min"] = 60 / (out["reset"] + limit * out["wrapper step"])
    out["episodes/min camera"] = 60 / (out["reset + camera"] + limit * out["step + camera"])
    env.close()
    return out


def expert_success(name: str, seeds: int) -> dict[str, str]:
    suite = get_suite(name)
    rates = {}
    for task in suite.task_names:
        env, expert = suite.make_env(task, 0), suite.expert(task)
        wins, lengths = 0, []
        for seed in range(seeds):
            outcome = run_policy_episode(env, lambda _obs, env=env, expert=expert: expert(env.expert_observation()),
                                         seed=seed)
            wins += outcome.success
            lengths.append(outcome.steps)
        rates[task] = f"{wins}/{seeds} (mean {np.mean(lengths):.0f} steps)"
        env.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps timed per measurement (default 300)")
    parser.add_argument("--experts", type=int, default=0, metavar="SEEDS",
                        help="also run the oracle expert on SEEDS seeds per task (default: no)")
    args = parser.parse_args()
    cols = ("raw step", "wrapper step", "step + camera", "reset", "reset + camera")
    print(f"| suite | {' | '.join(f'{c} (ms)' for c in cols)} | wrapper/raw | episodes/min/core | with camera |")
    print("|" + "---|" * (len(cols) + 4))
    for name in SUITES:
        r = bench_suite(name, args.steps)
        print(f"| {name} | " + " | ".join(f"{r[c] * 1e3:.2f}" for c in cols)
              + f" | {r['wrapper step'] / r['raw step']:.2f}× | {r['episodes/min']:.0f} | {r['episodes/min camera']:.0f} |")
    if args.experts:
        print(f"\n| suite | task | oracle expert successes (seeds 0..{args.experts - 1}) |\n|---|---|---|")
        for name in SUITES:
            for task, rate in expert_success(name, args.experts).items():
                print(f"| {name} | {task} | {rate} |")


if __name__ == "__main__":
    main()
