"""The suite registry: find a benchmark suite by name, list them, read the catalogue.

Each simulator module exposes ``suites() -> list[Suite]`` and imports its
simulator only when an environment is made, so ``get_suite``, ``list_suites``
and ``catalogue`` never load MuJoCo or pymunk (the evaluation API serves the
catalogue without any simulator installed). Adding a simulator is one module
plus one line in ``SIMULATOR_MODULES``.

    >>> from benchmarks.registry import get_suite
    >>> suite = get_suite("metaworld-mt1-reach")
    >>> env = suite.make_env("reach-v3", seed=7)
    >>> obs = env.reset()                    # {"state": float32[39], "task": "reach-v3"}
    >>> expert = suite.expert("reach-v3")
    >>> result = env.step(expert(env.expert_observation()))  # StepResult(obs, reward, success, done, info)
    >>> frames = env.render_images(suite.resolve_cameras(["corner"]))  # {"corner": uint8[96, 96, 3]}
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from benchmarks.suite import (
    DEMO_SEEDS,
    EVAL_SEED_START,
    CameraSpec,
    EpisodeEnv,
    ExpertPolicy,
    NoExpertError,
    StepResult,
    Suite,
    SuiteError,
    TaskSpec,
    close_matches,
    evaluation_seed,
)

__all__ = [
    "DEMO_SEEDS",
    "CameraSpec",
    "EVAL_SEED_START",
    "EpisodeEnv",
    "ExpertPolicy",
    "NoExpertError",
    "StepResult",
    "Suite",
    "SuiteError",
    "TaskSpec",
    "catalogue",
    "evaluation_seed",
    "get_suite",
    "list_suites",
]

SIMULATOR_MODULES = (
    "benchmarks.metaworld",
    "benchmarks.pusht",
    "benchmarks.libero",
    "benchmarks.aloha",
    "benchmarks.ogbench",
    "benchmarks.null",
)


@functools.cache
def _suites() -> dict[str, Suite]:
    found: dict[str, Suite] = {}
    for module_name in SIMULATOR_MODULES:
        for suite in importlib.import_module(module_name).suites():
            if suite.name in found:
                raise RuntimeError(f"suite {suite.name!r} is defined twice ({module_name} and "
                                   f"{found[suite.name].simulator})")
            found[suite.name] = suite
    return found


def list_suites() -> list[str]:
    """All suite names, sorted."""
    return sorted(_suites())


def get_suite(name: str) -> Suite:
    """The suite called ``name``; an unknown name raises ``SuiteError`` listing close matches."""
    suites = _suites()
    if name in suites:
        return suites[name]
    raise SuiteError(f"unknown benchmark suite {name!r}{close_matches(name, list(suites))} "
                     f"(`python -m benchmarks` lists all {len(suites)})")


def catalogue() -> list[dict[str, Any]]:
    """Every suite's facts — tasks, instructions, dims, state/action names, bounds, step limits,
    cameras — as JSON-ready dicts.

    Imports no simulator.
    """
    return [suite.catalogue_entry() for _, suite in sorted(_suites().items())]
