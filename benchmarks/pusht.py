"""PushT (gym-pusht, pymunk 2-D physics) as the EvalForge suite ``pusht``.

One task, ``push-t``: push the T-shaped block into the fixed goal pose. State
observation (5 values): agent x, y, block x, y (pixels in a 512 × 512 workspace)
and block angle (radians, [0, 2π)). Action (2 values): the agent's target
position in [0, 512]², tracked by a PD controller. 300 steps per episode (the
limit gym-pusht registers), 10 control steps per second. Success is gym-pusht's:
the block covers more than 95 % of the goal area; it ends the episode.

Seed → initial state: gym-pusht draws the agent and block poses from the
environment's ``np_random``; ``reset(seed=seed)`` reseeds it (gymnasium's
``SeedSequence``-based PCG64), so a seed always names the same start.

No scripted expert. gym-pusht ships none, and a hand-written pushing heuristic
that reaches 95 % coverage would be a research project of its own; a weak one
would only yield few, odd demonstrations. ``suite.expert("push-t")`` raises
``NoExpertError`` and ``trainer collect-demos --suite pusht`` refuses, saying so.
Use the human demonstrations of the ``lerobot/pusht`` dataset instead.

Camera ``top`` (default 96 × 96, gym-pusht's own observation size): gym-pusht's
pixel observation, the workspace seen from above — the same pygame drawing of the
goal, block and agent, resized with OpenCV to the requested height × width — drawn
offscreen on a pygame ``Surface`` (no window, no display) from the current physics
state, which drawing never changes. At 96 × 96 it is byte for byte the observation
``gym_pusht``'s ``obs_type="pixels"`` returns.

gym-pusht is imported only when an environment is made.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from benchmarks.suite import (
    CameraSpec,
    EpisodeEnv,
    SimObservation,
    Suite,
    TaskSpec,
    canonical_observation,
)

TASK = "push-t"
MAX_STEPS = 300
SEED_RULE = ("seed -> gym-pusht's reset(seed=seed), which reseeds the env's np_random (gymnasium's "
             "SeedSequence PCG64) that draws the agent and block poses")
"""Seed → initial state, as ``Suite.seed_rule`` says it (part of the suite's definition hash)."""
CAMERAS = (CameraSpec("top", 96, 96, "the workspace from above: goal (green), block and agent"),)


class PushTEnv(EpisodeEnv):
    """gym-pusht's PushT with state observations, reset from a seed."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        # pygame prints a banner on import; it would land in every worker's log.
        os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
        from gym_pusht.envs.pusht import PushTEnv as GymPushT

        # render_mode=None: state observations need no drawing surface.
        self._env = GymPushT(obs_type="state", render_mode=None)

    def _reset(self, seed: int) -> SimObservation:
        state, _ = self._env.reset(seed=seed)
        return canonical_observation(state, self.task)

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        state, reward, terminated, _, info = self._env.step(action.astype(np.float64))
        return canonical_observation(state, self.task), float(reward), bool(terminated), {
            "coverage": float(info["coverage"])}

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        # What gym-pusht's _render() does for a pixel observation, at our size and
        # without its render_mode switch (ours is None: no window is ever opened).
        frame = self._env._get_img(self._env._draw(), width=width, height=height, render_action=False)
        return np.ascontiguousarray(frame, dtype=np.uint8)

    def close(self) -> None:
        self._env.close()


def _make_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return PushTEnv(suite, task, seed)


def suites() -> list[Suite]:
    """The single PushT suite."""
    return [Suite(
        name="pusht",
        simulator="gym-pusht",
        description="PushT: push a T-shaped block into a goal pose (2-D; state, and a top camera)",
        tasks=(TaskSpec(TASK, "push the T-shaped block onto the goal", MAX_STEPS),),
        state_dim=5,
        action_dim=2,
        action_low=(0.0, 0.0),
        action_high=(512.0, 512.0),
        fps=10.0,
        env_factory=_make_env,
        no_expert_reason=("gym-pusht ships no scripted expert and EvalForge does not provide one; "
                          "train on human demonstrations (the lerobot/pusht dataset) instead"),
        state_names=("agent_x", "agent_y", "block_x", "block_y", "block_angle"),
        action_names=("target_x", "target_y"),
        cameras=CAMERAS,
        overview_camera="top",
        seed_rule=SEED_RULE,
    )]
