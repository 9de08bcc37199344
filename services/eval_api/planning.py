"""Turning a ``POST /evaluations`` request into episodes, checked against the suite catalogue.

The catalogue (``benchmarks.registry.catalogue()``) gives each suite's tasks,
dimensions and step limits without importing any simulator. A request is refused
(422, naming the fix) when the suite or a task does not exist, when the policy's
dimensions or task vocabulary do not fit the suite, when ``max_steps`` exceeds a
task's own limit, or when it asks for more episodes than the server allows.

Seeds: episode ``i`` of each task runs ``evaluation_seed(seed + i)`` — evaluation
seeds never overlap the demonstration seeds a policy was trained on, and every task
of one evaluation sees the same seed sequence.

Provenance: the plan carries the evaluation's protocol record
(``services.store.provenance.build_protocol``) and its suite's definition hash, stored with
it in the same transaction as its episodes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from benchmarks.registry import catalogue, get_suite
from benchmarks.suite import close_matches, evaluation_seed
from services.eval_api.errors import ApiError
from services.eval_api.schemas import EvaluationCreate
from services.protocol.adapters import IMAGES_RULE
from services.store.models import Policy
from services.store.provenance import build_protocol
from services.store.queries import EpisodeSpec


@functools.cache
def suites_by_name() -> dict[str, dict[str, Any]]:
    """The catalogue, by suite name (read once per process)."""
    return {entry["name"]: entry for entry in catalogue()}


@functools.cache
def current_definitions() -> dict[str, str]:
    """Suite → its current definition hash (``Suite.definition_hash``): the leaderboard version it ranks."""
    return {name: get_suite(name).definition_hash() for name in suites_by_name()}


def get_suite_entry(name: str) -> dict[str, Any]:
    """The catalogue entry of suite ``name``; a 422 ``unknown_suite`` listing close matches otherwise."""
    suites = suites_by_name()
    if name not in suites:
        raise ApiError(422, "unknown_suite", f"unknown suite {name!r}{close_matches(name, list(suites))}; "
                       f"GET /suites lists all {len(suites)}")
    return suites[name]


@dataclass(frozen=True)
class EvaluationPlan:
    tasks: list[str]
    episodes: list[EpisodeSpec]
    standard: bool
    cameras: dict[str, list[int]]
    inference: dict[str, Any]  # only the settings that differ from the defaults
    protocol: dict[str, Any]  # what produces its numbers (services.store.provenance)
    definition_hash: str  # the suite's Suite.definition_hash(): its leaderboard version


def plan_evaluation(request: EvaluationCreate, policy: Policy, *, max_episodes: int) -> EvaluationPlan:
    """The episodes ``request`` asks for, in task-major order; ``ApiError`` (422) if it cannot run."""
    suite = get_suite_entry(request.suite)
    limits = {task["name"]: task["max_steps"] for task in suite["tasks"]}
    tasks = list(request.tasks) if request.tasks is not None else list(limits)
    unknown = [task for task in tasks if task not in limits]
    if unknown:
        hint = close_matches(unknown[0], list(limits))
        raise ApiError(422, "unknown_task", f"suite {suite['name']} has no task {unknown[0]!r}{hint}; "
                       f"GET /suites/{suite['name']} lists its {len(limits)} tasks",
                       {"unknown_tasks": unknown})
    # A dimension the server did not say (openpi) is the suite's; every reply is checked against it.
    dims = (policy.state_dim or suite["state_dim"], policy.action_dim or suite["action_dim"])
    if dims != (suite["state_dim"], suite["action_dim"]):
        raise ApiError(422, "incompatible_policy",
                       f"policy {policy.id} ({policy.name}) has state/action dims {policy.state_dim}/"
                       f"{policy.action_dim} but suite {suite['name']} needs {suite['state_dim']}/"
                       f"{suite['action_dim']}; evaluate it on a suite with its dimensions")
    # A server that announced no tasks takes any instruction (openpi, vla-eval: language-conditioned).
    known = set(policy.tasks) if policy.tasks else set(tasks)
    missing = [task for task in tasks if task not in known]
    if missing:
        usable = [task for task in tasks if task in known]
        fix = (f"pass `tasks` with those it knows ({', '.join(usable[:10])})" if usable
               else "it knows none of this suite's tasks")
        raise ApiError(422, "incompatible_policy",
                       f"policy {policy.id} ({policy.name}) was not trained on task(s) {', '.join(missing[:10])} "
                       f"of suite {suite['name']}; {fix}", {"missing_tasks": missing})
    total = len(tasks) * request.episodes_per_task
    if total > max_episodes:
        raise ApiError(422, "too_many_episodes",
                       f"{len(tasks)} task(s) × {request.episodes_per_task} episodes = {total} episodes, over this "
                       f"server's limit of {max_episodes} per evaluation; lower episodes_per_task or split the "
                       "tasks over several evaluations", {"episodes": total, "limit": max_episodes})
    if request.max_steps is not None:
        over = {task: limits[task] for task in tasks if request.max_steps > limits[task]}
        if over:
            raise ApiError(422, "invalid_max_steps",
                           f"max_steps {request.max_steps} exceeds the step limit of task(s) "
                           f"{', '.join(f'{t} ({n})' for t, n in list(over.items())[:5])}; use at most "
                           f"{min(over.values())} or omit max_steps", {"limits": over})
    episodes = [EpisodeSpec(task=task, seed=evaluation_seed(request.seed + i),
                            max_steps=request.max_steps or limits[task])
                for task in tasks for i in range(request.episodes_per_task)]
    inference = request.inference
    horizon = inference.action_horizon
    if horizon is not None and policy.chunk_size is not None and horizon > policy.chunk_size:
        raise ApiError(422, "invalid_inference",
                       f"action_horizon {horizon} is longer than policy {policy.id}'s chunks of "
                       f"{policy.chunk_size} actions; use at most {policy.chunk_size}")
    # Non-default inference settings measure something else: ranked only among non-standard runs, marked.
    standard = (set(tasks) == set(limits) and all(spec.max_steps == limits[spec.task] for spec in episodes)
                and inference.is_default)
    cameras = plan_cameras(request, policy, suite)
    definition = get_suite(suite["name"])
    standard = standard and definition.leaderboard  # a plumbing suite (null) is never ranked
    definition_hash = current_definitions()[definition.name]
    step_limits = [(task, request.max_steps or limits[task]) for task in tasks]
    protocol = build_protocol(suite=definition.name, definition_hash=definition_hash, simulator=definition.simulator,
                              seed_rule=definition.seed_rule, step_limits=step_limits, seed=request.seed,
                              episodes_per_task=request.episodes_per_task, first_seed=evaluation_seed(request.seed),
                              cameras=cameras, inference=inference.model_dump(), policy=policy)
    return EvaluationPlan(tasks=tasks, episodes=episodes, standard=standard, cameras=cameras,
                          inference=inference.model_dump(exclude_none=True), protocol=protocol,
                          definition_hash=definition_hash)


def plan_cameras(request: EvaluationCreate, policy: Policy, suite: dict[str, Any]) -> dict[str, list[int]]:
    """The cameras the evaluation renders: the request's, else those the policy's handshake asks for.

    Every one must be a camera of the suite; a policy that declares cameras must get each of
    them at its own size (its server refuses any other image), so an override may only add. A
    server that declares none but whose ``observation_keys`` map ``images.<camera>`` fields gets
    those cameras, by default at the suite's sizes; an override must keep them, at any size.
    """
    available = {camera["name"]: camera for camera in suite.get("cameras", [])}
    declared = {name: list(size) for name, size in (policy.cameras or {}).items()}
    # A server that announces no sizes gets the cameras its key map names (any size; by default the suite's).
    keyed = [] if declared else [key.removeprefix("images.") for key in policy.observation_keys or {}
                                 if key.startswith("images.") and key != IMAGES_RULE]
    default = declared or {name: [available[name]["height"], available[name]["width"]]
                           for name in keyed if name in available}
    chosen = {name: list(size) for name, size in
              (request.cameras if request.cameras is not None else default).items()}
    unknown = [name for name in dict.fromkeys([*keyed, *chosen]) if name not in available]
    if unknown:
        offer = (f"its cameras are {', '.join(available)}" if available
                 else "it renders no cameras (a state-only suite)")
        raise ApiError(422, "unknown_camera",
                       f"suite {suite['name']} has no camera {unknown[0]!r}{close_matches(unknown[0], list(available))}"
                       f"; {offer}", {"unknown_cameras": unknown, "cameras": list(available)})
    mismatched = {name: size for name, size in declared.items() if chosen.get(name) != size}
    if mismatched:
        asked = ", ".join(f"{name} at {h}×{w}" for name, (h, w) in mismatched.items())
        raise ApiError(422, "incompatible_policy",
                       f"policy {policy.id} ({policy.name}) asks for camera(s) {asked} and its server refuses "
                       "any other image; leave `cameras` out to use the policy's own, or include those",
                       {"policy_cameras": declared})
    missing = [name for name in keyed if name not in chosen]
    if missing:
        raise ApiError(422, "incompatible_policy",
                       f"policy {policy.id} ({policy.name}) reads camera(s) {', '.join(missing)} (its "
                       "observation_keys); include them in `cameras`, or leave `cameras` out",
                       {"policy_cameras": keyed})
    return chosen
