"""Playing one episode of a suite with any policy: the loop every evaluation path shares.

``run_policy_episode(env, policy, seed=...)`` resets the environment to ``seed``'s initial
state, then asks ``policy(obs)`` for an action and steps, until the task succeeds
or its step limit ends the episode. The policy is any callable — a scripted
expert, an in-process model, or a remote policy server behind an action-chunk
broker — so the sequential reference (`trainer rollout`) and the distributed
workers run exactly the same loop.

A simulator exception is raised as ``EnvFailure`` (an evaluation records it as
``env_error``); an exception from the policy propagates unchanged, for the caller
to classify.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.suite import EpisodeEnv, SimObservation

Policy = Callable[[SimObservation], np.ndarray]


class EnvFailure(RuntimeError):
    """The simulator raised while resetting or stepping."""


@dataclass(frozen=True)
class EpisodeOutcome:
    task: str
    seed: int
    success: bool
    total_reward: float
    steps: int
    duration_s: float


def run_policy_episode(env: EpisodeEnv, policy: Policy, *, seed: int,
                on_step: Callable[[int], None] | None = None) -> EpisodeOutcome:
    """Play one episode from ``seed``'s initial state with ``policy``."""
    start = time.perf_counter()
    try:
        obs = env.reset(seed)
    except Exception as exc:
        raise EnvFailure(f"{env.suite.name}/{env.task} seed {seed}: reset failed: {exc!r}") from exc
    total, success = 0.0, False
    while True:
        action = policy(obs)
        try:
            result = env.step(action)
        except ValueError:
            raise  # a malformed action is the policy's fault, not the simulator's
        except Exception as exc:
            raise EnvFailure(f"{env.suite.name}/{env.task} seed {seed}: step {env.steps} failed: {exc!r}") from exc
        total += result.reward
        if on_step is not None:
            on_step(env.steps)
        if result.done:
            success = result.success
            break
        obs = result.obs
    return EpisodeOutcome(task=env.task, seed=seed, success=success, total_reward=total, steps=env.steps,
                          duration_s=time.perf_counter() - start)
