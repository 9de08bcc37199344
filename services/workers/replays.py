"""Replay GIFs of evaluation episodes: frames captured while a worker plays, one GIF per episode.

The first ``EVALFORGE_REPLAY_EPISODES`` episodes of each evaluation (by episode
index) are recorded: a ``ReplayRecorder`` grabs a frame after the reset and every
``EVALFORGE_REPLAY_EVERY`` steps with the simulator's ``render_images``, from the
camera ``replay_camera`` picks (``EVALFORGE_REPLAY_CAMERA``): by default what the
policy saw — of the evaluation's cameras, the suite's first, at the size the policy got — and for a
state-only policy, or with ``overview``, the suite's overview camera at 160×120.
``write_gif`` stores them under ``ARTIFACT_ROOT`` at
``evaluations/<evaluation id>/episode-<index>.gif`` — the path the episode row keeps
(``episodes.artifact_path``, relative to ``ARTIFACT_ROOT``, so the API and the
workers may mount the same volume at different places).

Replays are optional, never a reason to fail an episode: a suite without cameras,
or a host where no OpenGL context can be made (no EGL/OSMesa, no
display), is logged once per worker process and recording is skipped from then on.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.suite import EpisodeEnv, Suite

log = logging.getLogger("evalforge.workers.replays")

FRAME_WIDTH, FRAME_HEIGHT = 160, 120

_unavailable: str | None = None  # why rendering failed in this process (then it is not tried again)


def rendering_unavailable() -> str | None:
    """Why this process cannot render replays (logged once), or None while it can."""
    return _unavailable


def _give_up(reason: str) -> None:
    global _unavailable
    if _unavailable is None:
        log.warning("replays are off in this worker process: %s (episodes run as usual; set "
                    "EVALFORGE_REPLAY_EPISODES=0 to stop asking, or MUJOCO_GL=egl/osmesa with Mesa installed "
                    "to render headless)", reason)
    _unavailable = reason


ReplayCamera = tuple[str, tuple[int, int]]
"""A camera name and the (height, width) to render it at."""


def replay_camera(suite: Suite, cameras: Mapping[str, Sequence[int]] | None, choice: str) -> ReplayCamera | None:
    """The camera replays of an evaluation show (``choice``: ``policy`` or ``overview``); None if the suite has none.

    ``policy``: of the evaluation's ``cameras``, the one the suite lists first (a JSON
    document in PostgreSQL does not keep its keys' order, the suite's list does), at the
    size the policy got; with no cameras (a state-only policy), or for ``overview``, the
    suite's overview camera at 160×120.
    """
    if choice == "policy" and cameras:
        order = [camera.name for camera in suite.cameras]
        name = min(cameras, key=lambda n: order.index(n) if n in order else len(order))
        height, width = cameras[name]
        return name, (int(height), int(width))
    if suite.overview_camera is None:
        return None
    return suite.overview_camera, (FRAME_HEIGHT, FRAME_WIDTH)


class ReplayRecorder:
    """Frames of one try at an episode: ``capture(step)`` after reset (step 0) and after each step."""

    def __init__(self, env: EpisodeEnv, every: int, camera: ReplayCamera | None) -> None:
        self.env = env
        self.every = max(1, every)
        self.frames: list[np.ndarray] = []
        self.camera = camera
        self._last_step = -1
        if camera is None:  # this suite's episodes have no replay; other suites' still do
            log.debug("suite %s has no camera to record replays from", env.suite.name)

    @property
    def active(self) -> bool:
        return self.camera is not None and _unavailable is None

    def capture(self, step: int, *, last: bool = False) -> None:
        """Grab a frame at ``step`` if it is due (every ``every`` steps, and the ``last`` one)."""
        if not self.active or step == self._last_step or (step % self.every and not last):
            return
        assert self.camera is not None
        name, size = self.camera
        try:
            frame = self.env.render_images({name: size})[name]
        except Exception as exc:
            _give_up(f"{self.env.suite.name}/{self.env.task} cannot render offscreen: {type(exc).__name__}: {exc}")
            self.frames.clear()
            return
        self.frames.append(np.asarray(frame, dtype=np.uint8))
        self._last_step = step


def write_gif(frames: list[np.ndarray], path: Path, fps: float) -> None:
    """Write ``frames`` (uint8 RGB) as a looping GIF at ``path``, atomically (a reader never sees half a file)."""
    if not frames:
        raise ValueError(f"no frames to write to {path}")
    images = [Image.fromarray(frame) for frame in frames]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            images[0].save(out, format="GIF", save_all=True, append_images=images[1:],
                           duration=max(20, round(1000 / fps)), loop=0, optimize=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replay_path(evaluation_id: int, episode_index: int) -> str:
    """Where an episode's GIF lives, relative to ``ARTIFACT_ROOT`` (what the episode row stores)."""
    return f"evaluations/{evaluation_id}/episode-{episode_index:05d}.gif"


def save_replay(recorder: ReplayRecorder, artifact_root: Path, evaluation_id: int, episode_index: int,
                fps: float) -> str | None:
    """Write the recorder's frames; the path relative to ``artifact_root``, or None (nothing
    recorded, or the write failed — logged, the episode goes on)."""
    if len(recorder.frames) == 0:
        return None
    relative = replay_path(evaluation_id, episode_index)
    try:
        write_gif(recorder.frames, artifact_root / relative, fps)
    except OSError as exc:
        log.warning("episode %d of evaluation %d: could not write its replay under %s: %s; the episode is "
                    "recorded without one", episode_index, evaluation_id, artifact_root, exc)
        return None
    return relative
