"""Provenance: the protocol record an evaluation is made with, and what makes two evaluations comparable.

**The protocol record** (``evaluations.protocol``, JSON) is written by ``build_protocol``
when an evaluation is created, in the same transaction as its episodes, from what the API
knows then (it may have no simulator installed)::

    {
      "format_version": 1,
      "suite": "metaworld-mt1-reach", "definition_hash": "<sha256 of the suite's facts>",
      "simulator": "metaworld",
      "tasks": [{"name": "reach-v3", "max_steps": 200}],          # the step limits used
      "seeds": {"seed": 0, "episodes_per_task": 10, "first_seed": 1000000,
                "rule": "<the suite's seed → initial state rule>"},
      "cameras": {"corner": [96, 96]},
      "inference": {"action_horizon": null, "temporal_ensemble": null},
      "policy": {"id": 1, "name": "reach-bc", "version": "1", "protocol": "evalforge",
                 "checkpoint_sha256": "…", "revision": null},
      "evalforge": {"version": "0.1.0", "source_commit": "<git commit, or null>"}
    }

``definition_hash`` is ``benchmarks.suite.Suite.definition_hash()``: tasks, instructions,
step limits, dimensions, bounds, rate, cameras and the seed rule. Changing any of them gives
the suite a new hash, hence a new leaderboard version. The simulator's package versions and
renderer are facts of the worker, not of the API, so each episode records its own
(``episodes.simulator_versions``: ``{package: version}``; ``episodes.renderer``: for the MuJoCo
families ``MUJOCO_GL``, the OpenGL backend their frames were rendered with) and its
``worker_host``.

**Comparable** evaluations ran the same protocol: same suite and suite definition, tasks,
seeds (seed and episodes per task), step limits, cameras and inference settings.
``protocol_differences`` names each that differs. The policy is not part of it (comparing
two policies is the point), nor EvalForge's version or the simulators' (they are recorded
for the reader to judge; episodes show them). An evaluation made before protocols were
recorded (``protocol`` NULL) compares on its columns; its suite definition is unknown, so
it is never comparable with one whose definition is recorded.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from services.store.models import Evaluation, Policy
from services.store.statuses import inference_label

PROTOCOL_FORMAT_VERSION = 1
"""The layout of ``evaluations.protocol``; a reader of a later layout keeps reading this one."""


# ---------------------------------------------------------------------------- the record


def evalforge_version() -> str | None:
    """The installed ``evalforge`` distribution's version (None when run from an uninstalled tree)."""
    try:
        return metadata.version("evalforge")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def evalforge_source_commit() -> str | None:
    """The git commit of the running code, read once per process (the code does not change under it).

    (The store imports nothing of ours outside it, so this asks git itself, as ``policy_format``'s
    ``source_commit`` does for a checkpoint's provenance.)"""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def build_protocol(*, suite: str, definition_hash: str, simulator: str, seed_rule: str,
                   step_limits: Sequence[tuple[str, int]], seed: int, episodes_per_task: int, first_seed: int,
                   cameras: Mapping[str, Sequence[int]] | None, inference: Mapping[str, Any] | None,
                   policy: Policy) -> dict[str, Any]:
    """The protocol record of a new evaluation (the layout is in the module docstring).

    ``step_limits``: ``(task, max_steps)`` in the evaluation's task order, the limits its episodes
    run with; ``first_seed``: the simulator seed of each task's first episode.
    """
    return {
        "format_version": PROTOCOL_FORMAT_VERSION,
        "suite": suite,
        "definition_hash": definition_hash,
        "simulator": simulator,
        "tasks": [{"name": task, "max_steps": int(limit)} for task, limit in step_limits],
        "seeds": {"seed": int(seed), "episodes_per_task": int(episodes_per_task), "first_seed": int(first_seed),
                  "rule": seed_rule},
        "cameras": {name: [int(size[0]), int(size[1])] for name, size in (cameras or {}).items()},
        "inference": _inference(inference),
        "policy": {"id": policy.id, "name": policy.name, "version": policy.version, "protocol": policy.protocol,
                   "checkpoint_sha256": policy.checkpoint_sha256, "revision": policy.revision},
        "evalforge": {"version": evalforge_version(), "source_commit": evalforge_source_commit()},
    }


def _inference(inference: Mapping[str, Any] | None) -> dict[str, Any]:
    """Inference settings with both keys present (NULL or ``{}``: the defaults)."""
    inference = inference or {}
    return {"action_horizon": inference.get("action_horizon"), "temporal_ensemble": inference.get("temporal_ensemble")}


def provenance_line(protocol: Mapping[str, Any] | None) -> str:
    """One line naming what produced an evaluation's numbers, for terminals and page headers."""
    if not protocol:
        return "protocol not recorded (made before EvalForge recorded protocols)"
    policy = protocol.get("policy", {})
    identity = policy.get("checkpoint_sha256") or policy.get("revision")
    software = protocol.get("evalforge", {})
    commit = software.get("source_commit")
    return (f"suite definition {str(protocol.get('definition_hash'))[:12]} · "
            f"{inference_label(protocol.get('inference'))} · policy {policy.get('protocol')} "
            f"{str(identity)[:12] if identity else 'unidentified'} · evalforge {software.get('version') or '?'}"
            f"{f' @ {commit[:10]}' if commit else ''}")


# ---------------------------------------------------------------------------- comparability


def protocol_differences(baseline: Evaluation, candidate: Evaluation) -> list[str]:
    """What differs between two evaluations' protocols, one ``"field: baseline X, candidate Y"`` each.

    Empty: they are comparable (episodes pair by task and seed). Fields, in this order:
    ``suite``, ``suite definition``, ``tasks``, ``seeds``, ``max_steps``, ``cameras``,
    ``inference``. Step limits compare per task when both record a protocol, else on the
    ``max_steps`` columns (None: each task's own limit).
    """
    differences = []
    if baseline.suite != candidate.suite:
        differences.append(f"suite: baseline {baseline.suite}, candidate {candidate.suite}")
    if baseline.definition_hash != candidate.definition_hash:
        differences.append(f"suite definition: baseline {_definition(baseline.definition_hash)}, "
                           f"candidate {_definition(candidate.definition_hash)}")
    if set(baseline.tasks) != set(candidate.tasks):
        differences.append(f"tasks: {_task_difference(baseline.tasks, candidate.tasks)}")
    seeds = [(e.seed, e.episodes_per_task, _protocol_seeds(e).get("first_seed")) for e in (baseline, candidate)]
    if seeds[0][:2] != seeds[1][:2] or (None not in (seeds[0][2], seeds[1][2]) and seeds[0][2] != seeds[1][2]):
        differences.append(f"seeds: baseline {_seeds(baseline)}, candidate {_seeds(candidate)}")
    limit_difference = _step_limit_difference(baseline, candidate)
    if limit_difference:
        differences.append(f"max_steps: {limit_difference}")
    cameras = [_cameras(e.cameras) for e in (baseline, candidate)]
    if cameras[0] != cameras[1]:
        differences.append(f"cameras: baseline {cameras[0]}, candidate {cameras[1]}")
    inference = [_inference(e.inference) for e in (baseline, candidate)]
    if inference[0] != inference[1]:
        differences.append(f"inference: baseline {inference_label(inference[0])}, "
                           f"candidate {inference_label(inference[1])}")
    return differences


def _definition(definition_hash: str | None) -> str:
    return definition_hash[:12] if definition_hash else "not recorded (made before provenance was)"


def _task_difference(baseline: Sequence[str], candidate: Sequence[str]) -> str:
    only_baseline = [t for t in baseline if t not in set(candidate)]
    only_candidate = [t for t in candidate if t not in set(baseline)]
    parts = [f"baseline {len(baseline)}, candidate {len(candidate)}"]
    for side, tasks in (("baseline", only_baseline), ("candidate", only_candidate)):
        if tasks:
            more = f" and {len(tasks) - 5} more" if len(tasks) > 5 else ""
            parts.append(f"only in {side}: {', '.join(tasks[:5])}{more}")
    return "; ".join(parts)


def _protocol_seeds(evaluation: Evaluation) -> dict[str, Any]:
    return (evaluation.protocol or {}).get("seeds") or {}


def _seeds(evaluation: Evaluation) -> str:
    return f"seed {evaluation.seed} × {evaluation.episodes_per_task} episodes per task" + (
        f" (first simulator seed {first})" if (first := _protocol_seeds(evaluation).get("first_seed")) is not None
        else "")


def _step_limits(evaluation: Evaluation) -> dict[str, int] | None:
    tasks = (evaluation.protocol or {}).get("tasks")
    return {task["name"]: task["max_steps"] for task in tasks} if tasks else None


def _step_limit_difference(baseline: Evaluation, candidate: Evaluation) -> str:
    """The step limits that differ, per task where both protocols say them; ``""`` when none does."""
    limits = [_step_limits(baseline), _step_limits(candidate)]
    if limits[0] is not None and limits[1] is not None:
        differing = [(task, limit, limits[1][task]) for task, limit in limits[0].items()
                     if task in limits[1] and limits[1][task] != limit]
        more = f" and {len(differing) - 5} more tasks" if len(differing) > 5 else ""
        return "; ".join(f"{task} baseline {b}, candidate {c}" for task, b, c in differing[:5]) + (
            more if differing else "")
    if baseline.max_steps == candidate.max_steps:
        return ""
    return f"baseline {_max_steps(baseline.max_steps)}, candidate {_max_steps(candidate.max_steps)}"


def _max_steps(max_steps: int | None) -> str:
    return "each task's own limit" if max_steps is None else str(max_steps)


def _cameras(cameras: Mapping[str, Sequence[int]] | None) -> str:
    """``corner 96×96, gripper 64×64`` in name order (JSONB keeps no key order), or ``none (state only)``."""
    if not cameras:
        return "none (state only)"
    return ", ".join(f"{name} {size[0]}×{size[1]}" for name, size in sorted(cameras.items()))
