"""Rollout recording: the episodes an evaluation asks for, kept as LeRobot v3 training data.

An evaluation's ``record`` (``RecordMode``, ``POST /evaluations``) names which episodes are kept:

- ``none`` (the default): nothing is recorded and nothing is rendered for it;
- ``first``: the first episode of each task (its lowest episode index; episodes are planned
  task-major, so the index is a multiple of ``episodes_per_task``), whatever its outcome;
- ``failures``: every episode that ran to its end without success (out of steps): the cases a
  policy needs more data for;
- ``all``: every episode that ran to its end.

Only episodes that ran to their end are kept: one cut short by a harness or policy-server failure
(``failure_reason`` set) is not a rollout of the policy. Only the last try of an episode counts (a
retried episode restarts from its seed).

While an episode to be recorded plays, ``RolloutRecorder`` keeps, at every step, the state the policy
observed, the action the simulator applied (clipped to the suite's bounds, as ``EpisodeEnv.step``
does) and a frame of each of the evaluation's cameras at the size the policy gets them (none for a
state-only evaluation). Frames are rendered at every step, not only at the inference steps the policy
sees them at, because a training dataset needs one per action; rendering reads the simulator and
never changes it, so recording changes no outcome (and is no part of the comparability protocol).
Memory: the frames of one episode (T × H × W × 3 bytes per camera) until it ends; then each camera is
encoded once, here, as LeRobot encodes it (``lerobot_format.CameraFrames``: AV1, one encoder thread),
and the episode is written to ``ARTIFACT_ROOT/evaluations/<id>/recordings/episode-<index>.npz``
(``lerobot_format.episode_file``), the path its row keeps (``episodes.recording_path``).
``services/eval_api/datasets.py`` joins an evaluation's recordings into one dataset.

The dataset's ``next.reward`` is 0 throughout (rewards are not recorded); ``next.success`` and the
episode's ``success`` say how it ended. Recording, like a replay, never fails an episode: a camera
that cannot be rendered, or a write that fails, is logged and the episode is stored without one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.suite import EpisodeEnv, SimObservation
from lerobot_format import CameraFrames, Episode
from lerobot_format.episode_file import save_episode
from services.store.statuses import RecordMode

log = logging.getLogger("evalforge.workers.recording")


def is_recorded(record: str | None, episode_index: int, episodes_per_task: int) -> bool:
    """Whether an episode of an evaluation with ``record`` is played with a recorder (before it runs)."""
    mode = RecordMode(record or RecordMode.NONE)
    if mode == RecordMode.NONE:
        return False
    if mode == RecordMode.FIRST:
        return episode_index % max(1, episodes_per_task) == 0
    return True


def is_kept(record: str | None, *, success: bool, failure_reason: str | None) -> bool:
    """Whether a recorded episode's recording is written, now that it is over."""
    if failure_reason is not None:
        return False  # cut short by the harness or the policy server: not a rollout of the policy
    mode = RecordMode(record or RecordMode.NONE)
    return mode != RecordMode.NONE and (mode != RecordMode.FAILURES or not success)


def recording_path(evaluation_id: int, episode_index: int) -> str:
    """Where an episode's recording lives, relative to ``ARTIFACT_ROOT`` (what the episode row stores)."""
    return f"evaluations/{evaluation_id}/recordings/episode-{episode_index:05d}.npz"


class RolloutRecorder:
    """One try at an episode: ``wrap(policy)`` records each step's state, action and camera frames."""

    def __init__(self, env: EpisodeEnv, cameras: Mapping[str, Sequence[int]] | None) -> None:
        self.env = env
        self.sizes = {name: (int(height), int(width)) for name, (height, width) in (cameras or {}).items()}
        self.states: list[np.ndarray] = []
        self.actions: list[np.ndarray] = []
        self.frames: dict[str, list[np.ndarray]] = {name: [] for name in self.sizes}
        self.broken: str | None = None  # why this try's recording was given up

    def wrap(self, policy: Callable[[SimObservation], np.ndarray]) -> Callable[[SimObservation], np.ndarray]:
        """``policy``, recording what it observed and the action the simulator will apply."""
        suite = self.env.suite

        def act(obs: SimObservation) -> np.ndarray:
            if self.sizes and self.broken is None:
                try:
                    for name, frame in self.env.render_images(self.sizes).items():
                        self.frames[name].append(np.asarray(frame, dtype=np.uint8))
                except Exception as exc:
                    self.broken = f"rendering {', '.join(self.sizes)} failed: {type(exc).__name__}: {exc}"
            action = policy(obs)
            state = np.array(obs["state"], dtype=np.float32)
            applied = np.asarray(action, dtype=np.float32).reshape(-1)
            if applied.shape == (suite.action_dim,):  # a malformed one fails the episode in step() anyway
                self.states.append(state)
                self.actions.append(np.clip(applied, suite.action_low_array, suite.action_high_array))
            return action

        return act


def save_recording(recorder: RolloutRecorder, artifact_root: Path, *, evaluation_id: int, episode_index: int,
                   seed: int, success: bool, extra: Mapping[str, Any] | None = None) -> str | None:
    """Encode and write ``recorder``'s episode; its path relative to ``artifact_root``, or None (nothing
    recorded, rendering or the write failed — logged, the episode is stored without a recording)."""
    where = f"episode {episode_index} of evaluation {evaluation_id}"
    if recorder.broken is not None:
        log.warning("%s: not recorded: %s", where, recorder.broken)
        return None
    if not recorder.states:
        return None
    suite = recorder.env.suite
    length = len(recorder.states)
    try:
        cameras = {name: CameraFrames.encode(np.stack(frames[:length]), fps=int(suite.fps))
                   for name, frames in recorder.frames.items()}
        episode = Episode(task=recorder.env.task, state=np.stack(recorder.states), action=np.stack(recorder.actions),
                          success=success, seed=seed, cameras=cameras)
        relative = recording_path(evaluation_id, episode_index)
        save_episode(artifact_root / relative, episode, fps=suite.fps, instruction=suite.instruction(recorder.env.task),
                     extra={"suite": suite.name, "evaluation_id": evaluation_id, "episode_index": episode_index,
                            "state_names": list(suite.state_names), "action_names": list(suite.action_names),
                            "robot_type": suite.simulator, **(extra or {})})
    except (OSError, ValueError) as exc:
        log.warning("%s: could not write its recording under %s: %s; the episode is stored without one",
                    where, artifact_root, exc)
        return None
    return relative
