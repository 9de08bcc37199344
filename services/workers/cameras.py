"""Camera frames for the policy, rendered only when the policy server is asked for actions.

An evaluation records the cameras its policy is shown (``evaluations.cameras``,
``{camera: [height, width]}``). ``observing_policy(env, broker, cameras)`` wraps an
action-chunk broker as the episode loop's policy: at a step where the broker will
infer (its chunk is used up), it renders those cameras from the simulator's current
state and adds them to the observation as ``images``; at a step served from the chunk
it renders nothing — the observation would not be looked at. A state-only evaluation
(no cameras) gets the broker itself, so it never renders.

A camera that cannot be rendered (no OpenGL on the worker host, a simulator error) is
the harness's fault, not the policy's: it is raised as ``EnvFailure`` (``env_error``).
The distributed workers (``runner.py``) and the sequential rollout (``rollout.py``)
both use this, so both show a policy the same frames.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.runner import EnvFailure
from benchmarks.suite import EpisodeEnv, SimObservation
from services.protocol.ensemble import Broker


def observing_policy(env: EpisodeEnv, broker: Broker,
                     cameras: Mapping[str, Sequence[int]] | None, *,
                     task_text: str | None = None) -> Callable[[SimObservation], np.ndarray]:
    """``broker.act``, with ``cameras`` rendered into the observation at the steps it infers.

    ``task_text`` replaces the observation's task name (what a language-conditioned policy of
    another protocol is told: the task's instruction).
    """
    sizes = {name: (int(height), int(width)) for name, (height, width) in (cameras or {}).items()}
    if not sizes and task_text is None:
        return broker.act

    def act(obs: SimObservation) -> np.ndarray:
        if broker.needs_observation:
            obs = {**obs, "task": task_text} if task_text is not None else dict(obs)
            if sizes:
                obs["images"] = render(env, sizes)
        return broker.act(obs)

    return act


def render(env: EpisodeEnv, sizes: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """The current frames of ``sizes``' cameras; ``EnvFailure`` when the simulator cannot draw them."""
    try:
        return env.render_images(sizes)
    except Exception as exc:
        raise EnvFailure(f"{env.suite.name}/{env.task} step {env.steps}: rendering camera(s) "
                         f"{', '.join(sizes)} failed: {type(exc).__name__}: {exc} (headless hosts need "
                         "MUJOCO_GL=egl or osmesa with Mesa installed)") from exc
