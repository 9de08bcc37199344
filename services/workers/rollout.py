"""The sequential rollout: every (task, evaluation seed) episode of a suite, one after another, in this process.

``rollout(url, suite, tasks, episodes_per_task)`` plays the episodes against the
policy server at ``url`` with the same loop as the distributed workers
(``benchmarks.runner.run_policy_episode``) and an action-chunk broker, on evaluation
seeds (``benchmarks.suite.evaluation_seed``), never a demonstration seed.
The policy is shown the cameras its handshake asks for, rendered at the steps it is
asked for actions (``services/workers/cameras.py``), as in the workers. ``summarize`` turns its results into the store's figures
(``services.store.aggregates``: success rates with Wilson 95% intervals, harness
failures left out), so this sequential reference and an evaluation through the API
compute the same numbers from the same episodes. A simulator failure is recorded
for its episode as ``env_error`` (and the environment made anew), as a worker
records it; an error of the policy server ends the rollout.

It needs no database or broker: only the policy client (``services.protocol``), the
suites and the store's pure aggregate functions. The command around it
(``evalforge rollout``, ``trainer rollout``) is ``services/cli/rollout.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict

import numpy as np

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_policy_episode
from benchmarks.suite import EpisodeEnv, Suite, evaluation_seed
from services.protocol.client import PolicyClient, latency_summary_ms
from services.protocol.ensemble import make_broker
from services.store import aggregates
from services.store.models import EpisodeStatus, FailureReason
from services.workers.cameras import observing_policy


class PolicyMismatch(ValueError):
    """The policy's dimensions or task tokens do not fit the suite it is to be evaluated on."""


def check_policy_fits_suite(client: PolicyClient, suite_name: str, tasks: list[str]) -> None:
    """``PolicyMismatch`` naming what differs, if the connected policy cannot play ``tasks`` of the suite."""
    suite = get_suite(suite_name)
    meta = client.metadata
    problems = []
    if meta.state_dim != suite.state_dim or meta.action_dim != suite.action_dim:
        problems.append(f"dims state {meta.state_dim}/action {meta.action_dim}, the suite has "
                        f"{suite.state_dim}/{suite.action_dim}")
    missing = [t for t in tasks if t not in meta.tasks]
    if missing:
        problems.append(f"no task token for {', '.join(missing)}")
    available = {camera.name for camera in suite.cameras}
    unseen = [name for name in meta.cameras if name not in available]
    if unseen:
        problems.append(f"it asks for camera(s) {', '.join(unseen)}; the suite renders "
                        f"{', '.join(sorted(available)) or 'no cameras'}")
    if problems:
        raise PolicyMismatch(f"policy {meta.policy_name!r} does not fit suite {suite_name}: {'; '.join(problems)}")


def rollout(url: str, suite_name: str, tasks: list[str], episodes_per_task: int, *,
            max_steps: int | None = None, first_episode: int = 0,
            on_episode: Callable[[str, int], None] | None = None,
            inference: dict | None = None) -> list[dict]:
    """Play every (task, evaluation seed) episode in order; one result dict per episode.

    ``on_episode(task, seed)`` is called as each episode starts (the command's progress
    bar). ``inference`` is an evaluation's inference settings (``services.protocol.ensemble``). Raises ``PolicyMismatch`` before the first episode if the policy at ``url``
    does not fit the suite.
    """
    with PolicyClient(url) as client:
        check_policy_fits_suite(client, suite_name, tasks)
        cameras = client.metadata.cameras  # what the policy asks to see, rendered only when it infers

        def policy_for(env: EpisodeEnv, task: str, seed: int) -> tuple[Callable, list[float]]:
            broker = make_broker(client, inference, episode_id=f"rollout-{task}-{seed}")
            return observing_policy(env, broker, cameras), broker.latencies_s

        return _play(get_suite(suite_name), tasks, episodes_per_task, policy_for, max_steps=max_steps,
                     first_episode=first_episode, on_episode=on_episode)


def expert_rollout(suite_name: str, tasks: list[str], episodes_per_task: int, *,
                   max_steps: int | None = None, first_episode: int = 0,
                   on_episode: Callable[[str, int], None] | None = None) -> list[dict]:
    """``rollout`` with the suite's scripted expert in place of a policy server: the baseline a
    policy's success is read against, on the same evaluation seeds. The expert sees
    ``env.expert_observation()`` (a pixel suite's hidden goal included) and renders nothing.
    ``benchmarks.suite.NoExpertError`` if the suite has none."""
    suite = get_suite(suite_name)
    experts = {task: suite.expert(task) for task in tasks}  # fails before any episode if there is none

    def policy_for(env: EpisodeEnv, task: str, seed: int) -> tuple[Callable, list[float]]:
        return (lambda _obs: experts[task](env.expert_observation())), []

    return _play(suite, tasks, episodes_per_task, policy_for, max_steps=max_steps,
                 first_episode=first_episode, on_episode=on_episode)


def _play(suite: Suite, tasks: list[str], episodes_per_task: int,
          policy_for: Callable[[EpisodeEnv, str, int], tuple[Callable, list[float]]], *,
          max_steps: int | None, first_episode: int,
          on_episode: Callable[[str, int], None] | None) -> list[dict]:
    """The episodes of ``rollout``: ``policy_for(env, task, seed)`` gives each its policy and
    the list its action latencies (seconds) are appended to."""
    results: list[dict] = []

    def make_env(task: str) -> EpisodeEnv:
        env = suite.make_env(task, evaluation_seed(first_episode))
        if max_steps is not None:
            env.max_steps = max_steps
        return env

    for task in tasks:
        env = make_env(task)
        try:
            for i in range(episodes_per_task):
                seed = evaluation_seed(first_episode + i)
                if on_episode is not None:
                    on_episode(task, seed)
                policy, latencies = policy_for(env, task, seed)
                started = time.perf_counter()
                try:
                    outcome = run_policy_episode(env, policy, seed=seed)
                    result = {**asdict(outcome), "failure_reason": None, "error_message": None}
                except EnvFailure as exc:  # the simulator's fault: recorded, left out of the rates
                    result = {"task": task, "seed": seed, "success": False, "total_reward": None,
                              "steps": None, "duration_s": time.perf_counter() - started,
                              "failure_reason": FailureReason.ENV_ERROR.value, "error_message": str(exc)}
                    env.close()
                    env = make_env(task)
                latency_mean_ms, latency_p95_ms = latency_summary_ms(latencies)
                results.append({**result, "inferences": len(latencies),
                                "latency_mean_ms": latency_mean_ms, "latency_p95_ms": latency_p95_ms})
        finally:
            env.close()
    return results


def episode_result(result: dict) -> aggregates.EpisodeResult:
    """A rollout episode as the store's aggregates read an episode row."""
    status = EpisodeStatus.SUCCEEDED if result["success"] else EpisodeStatus.FAILED
    return aggregates.EpisodeResult(task=result["task"], status=status.value, success=bool(result["success"]),
                                    steps=result["steps"], latency_mean_ms=result["latency_mean_ms"],
                                    latency_p95_ms=result["latency_p95_ms"],
                                    failure_reason=result.get("failure_reason"))


def summarize(results: list[dict], tasks: list[str] | None = None) -> list[dict]:
    """Per-task rows (in ``tasks`` order, then any other task) and an overall row ``"all"``.

    Each row is the store's figures for its episodes (``aggregates.summarize_group``:
    episodes, scored, succeeded, success rate, Wilson 95% interval, mean steps, latency
    p50/p95, failure reasons), plus ``episode_s``, the mean seconds per episode.
    """
    order = [*(tasks or ()), *(r["task"] for r in results)]
    groups = {task: [r for r in results if r["task"] == task] for task in dict.fromkeys(order)}
    groups["all"] = results
    return [{"task": task, **aggregates.summarize_group([episode_result(r) for r in episodes]),
             "episode_s": float(np.mean([r["duration_s"] for r in episodes]))}
            for task, episodes in groups.items() if episodes]
