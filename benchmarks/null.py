"""The ``null`` suite: an environment that does nothing, for measuring the service's plumbing alone.

Not a benchmark. An episode of task ``null`` costs no physics: ``reset`` and ``step`` return
a zero state, every episode lasts exactly its step limit (default ``MAX_STEPS``, or the
evaluation's ``max_steps``), and whether it succeeds is drawn from its seed
(``numpy.random.default_rng([crc32("null"), seed]).random() < SUCCESS_RATE``) and revealed
at its last step, so the same seeds give the same outcomes everywhere. Against
``policy-server --engine null`` (which answers at once with zero actions) an evaluation
measures only the API, the broker, the workers and the store: ``bench/control_plane.py``.

Marked ``leaderboard=False``: its evaluations are never ``standard`` and the leaderboard
(API and page) never ranks it. Its simulator family ``null`` needs no package beyond
EvalForge itself (``benchmarks/simulators.py``), so every worker can serve it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from benchmarks.suite import EpisodeEnv, SimObservation, Suite, TaskSpec, canonical_observation

TASK = "null"
MAX_STEPS = 10
STATE_DIM, ACTION_DIM = 4, 2
SUCCESS_RATE = 0.5
SEED_RULE = (f"seed -> numpy default_rng([crc32('null'), seed]).random() < {SUCCESS_RATE} decides success, "
             "revealed at the last step; the state is always zero")
"""Seed → outcome, as ``Suite.seed_rule`` says it (part of the suite's definition hash)."""


def seeded_success(task: str, seed: int) -> bool:
    """Whether the episode of ``task`` from ``seed`` succeeds."""
    return bool(np.random.default_rng([zlib.crc32(task.encode()), seed]).random() < SUCCESS_RATE)


class NullEnv(EpisodeEnv):
    """Steps cost nothing; the episode lasts its step limit and succeeds as its seed says."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        self._state = np.zeros(STATE_DIM, dtype=np.float32)
        self._success = False

    def _reset(self, seed: int) -> SimObservation:
        self._success = seeded_success(self.task, seed)
        return canonical_observation(self._state, self.task)

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        last = self.steps + 1 >= self.max_steps  # self.steps counts the steps before this one
        success = last and self._success
        return canonical_observation(self._state, self.task), float(success), success, {}

    def close(self) -> None:
        pass


def _null_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return NullEnv(suite, task, seed)


def _null_expert(suite: Suite, task: str):  # noqa: ANN202 - ExpertPolicy
    zeros = np.zeros(ACTION_DIM, dtype=np.float32)
    return lambda obs: zeros


def suites() -> list[Suite]:
    return [Suite(
        name="null", simulator="null",
        description=("Plumbing measurement, not a benchmark: an environment that does nothing, a fixed number of "
                     "steps and a seeded success. Never on the leaderboard."),
        tasks=(TaskSpec(TASK, "do nothing", MAX_STEPS),),
        state_dim=STATE_DIM, action_dim=ACTION_DIM, action_low=(-1.0,) * ACTION_DIM,
        action_high=(1.0,) * ACTION_DIM, fps=10.0, env_factory=_null_env, expert_factory=_null_expert,
        state_names=tuple(f"zero_{i}" for i in range(STATE_DIM)),
        action_names=tuple(f"ignored_{i}" for i in range(ACTION_DIM)),
        seed_rule=SEED_RULE, leaderboard=False,
    )]
