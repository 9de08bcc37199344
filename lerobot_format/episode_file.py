"""One episode in one file: what a process that plays episodes writes, and what assembles a dataset reads.

A dataset is written whole (``write_dataset``), but its episodes are played one at a time, by many
processes (evaluation workers recording rollouts). Each writes its episode here as it ends — states,
actions, rewards, and each camera's frames already encoded the way the dataset stores them
(``CameraFrames``: an AV1 video, or PNGs) — so that building the dataset only joins them.

The file is an ``.npz`` of plain arrays (loaded with ``allow_pickle=False``)::

    meta                      uint8: UTF-8 JSON {"format": "lerobot-format-episode", "version": 1, "task",
                              "instruction", "success", "seed", "fps", "cameras": [names], ...extra}
    state, action             float32 [T, D], [T, A]
    reward                    float32 [T] (absent: not recorded)
    camera.<name>.shape       int64 [T, H, W]
    camera.<name>.histogram   int64 [3, 256]; camera.<name>.sampled: int64 (CameraFrames' statistics)
    camera.<name>.video       uint8: the mp4 bytes (video cameras), or
    camera.<name>.png, .png_ends   uint8: the PNGs back to back, int64: where each ends (image cameras)

It is written atomically (a reader never sees half a file).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lerobot_format.dataset import CameraFrames, DatasetError, Episode

FORMAT = "lerobot-format-episode"
VERSION = 1


def save_episode(path: Path | str, episode: Episode, *, fps: float, instruction: str = "",
                 extra: Mapping[str, Any] | None = None) -> None:
    """Write ``episode`` (with its encoded ``cameras``) to ``path``; ``extra`` goes into its JSON meta."""
    path = Path(path)
    meta = {**(extra or {}), "format": FORMAT, "version": VERSION, "task": episode.task,
            "instruction": instruction, "success": bool(episode.success), "seed": episode.seed, "fps": fps,
            "cameras": list(episode.cameras)}
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
        "state": np.ascontiguousarray(episode.state, dtype=np.float32),
        "action": np.ascontiguousarray(episode.action, dtype=np.float32),
    }
    if episode.reward is not None:
        arrays["reward"] = np.asarray(episode.reward, dtype=np.float32)
    for name, frames in episode.cameras.items():
        arrays |= camera_arrays(name, frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_episode(path: Path | str) -> tuple[Episode, dict[str, Any]]:
    """The episode ``save_episode`` wrote at ``path`` and its meta; ``DatasetError`` naming the file if it
    is not one."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes())
            if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
                raise DatasetError(f"{path}: not an episode file of version ≤ {VERSION} (format {meta.get('format')!r}, "
                                   f"version {meta.get('version')!r}); rewrite it with this version")
            cameras = {}
            for name in meta.get("cameras", []):
                if (frames := camera_frames(data, name)) is None:
                    raise DatasetError(f"{path}: its meta names camera {name!r} but the file holds no frames of it")
                cameras[name] = frames
            episode = Episode(task=str(meta["task"]), state=data["state"], action=data["action"],
                              reward=data["reward"] if "reward" in data else None, success=bool(meta["success"]),
                              seed=meta.get("seed"), cameras=cameras)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{path}: unreadable episode file ({type(exc).__name__}: {exc}); record the episode "
                           "again or leave it out") from None
    return episode, meta


def camera_arrays(camera: str, frames: CameraFrames) -> dict[str, np.ndarray]:
    """A camera's encoded frames as plain arrays for an episode's .npz (no pickled objects);
    ``camera_frames`` reads them back. trainer collect-demos keeps its shards the same way."""
    arrays = {f"camera.{camera}.shape": np.array([frames.length, frames.height, frames.width], np.int64),
              f"camera.{camera}.histogram": np.asarray(frames.histogram, np.int64),
              f"camera.{camera}.sampled": np.int64(frames.sampled)}
    if frames.video is not None:
        arrays[f"camera.{camera}.video"] = np.frombuffer(frames.video, np.uint8)
    else:
        pngs = frames.png or []
        arrays[f"camera.{camera}.png"] = np.frombuffer(b"".join(pngs), np.uint8)
        arrays[f"camera.{camera}.png_ends"] = np.cumsum([len(p) for p in pngs]).astype(np.int64)
    return arrays


def camera_frames(data: Any, camera: str) -> CameraFrames | None:
    """What ``camera_arrays`` saved of ``camera`` in ``data`` (an opened .npz), back as ``CameraFrames``;
    None when it holds no frames of that camera."""
    if f"camera.{camera}.shape" not in data:
        return None
    length, height, width = (int(v) for v in data[f"camera.{camera}.shape"])
    common = {"height": height, "width": width, "length": length,
              "histogram": data[f"camera.{camera}.histogram"], "sampled": int(data[f"camera.{camera}.sampled"])}
    if f"camera.{camera}.video" in data:
        return CameraFrames(**common, video=data[f"camera.{camera}.video"].tobytes())
    blob, ends = data[f"camera.{camera}.png"].tobytes(), data[f"camera.{camera}.png_ends"]
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return CameraFrames(**common, png=[blob[a:b] for a, b in zip(starts, ends, strict=True)])
