"""Robot demonstration datasets in the LeRobot v3.0 layout: the writer and the reader.

The format, once: the trainer reads and writes demonstrations with it (``trainer collect-demos``,
``trainer vla``) and the evaluation workers write recorded rollouts with it
(``services/workers/recording.py``). A leaf: numpy, pyarrow and PyAV (``av``) only, nothing of ours.

Layout (``codebase_version`` "v3.0"), file for file what LeRobot 0.6.1's own writer
makes, so ``lerobot.datasets.lerobot_dataset.LeRobotDataset(repo_id, root=...)`` loads
it (``docs/datasets.md`` says how to check)::

    meta/info.json                              fps (int), features (dtype/shape/names[/info]), totals,
                                                path templates, file size limits
    meta/stats.json                             per feature: min, max, mean, std, count, q01, q10, q50, q90, q99
    meta/tasks.parquet                          task_index column; the task text is the pandas index
    meta/episodes/chunk-000/file-000.parquet    one row per episode (below)
    meta/evalforge.json                         EvalForge's own: suite, task names, how it was collected
    data/chunk-XXX/file-YYY.parquet             one row per frame, episodes whole and in order, a row
                                                group per episode
    videos/observation.images.<camera>/chunk-XXX/file-YYY.mp4    (video cameras) episodes back to back

Frame columns: ``observation.state`` (float32 [D]), ``action`` (float32 [A], the action
applied after observing the state), optionally ``observation.environment_state`` (float32 [E],
LeRobot's name for state the robot does not observe itself: what a pixel suite hides from the
policy, such as its goal, kept as privileged information for training-time auxiliary targets), ``next.reward`` (float32), ``next.done`` and
``next.success`` (bool, true on the last frame of an episode / of a successful one),
``timestamp`` (float32 seconds, ``frame_index / fps``), ``frame_index``,
``episode_index``, ``index`` (global frame index) and ``task_index`` (int64).

Cameras are features ``observation.images.<camera>`` (uint8 [H, W, 3], names
``["height", "width", "channels"]``) of one of two dtypes:

- ``video`` (the default): each episode encoded as LeRobot encodes it — PyAV,
  ``libsvtav1``, ``g`` 2, ``crf`` 30, preset 12, ``yuv420p`` — then episodes of a camera
  joined without re-encoding into ``file-YYY.mp4`` files of up to ``video_files_size_in_mb``;
  the feature's ``info`` block records the stream and encoder, and each episode row says
  where its frames are (``videos/<key>/chunk_index``, ``file_index``, ``from_timestamp``,
  ``to_timestamp``). Frame ``i`` of an episode is at ``from_timestamp + i / fps``.
- ``image``: a PNG per frame inside the data parquet (a struct ``{bytes, path}``, the
  Hugging Face ``Image`` type), lossless and simple for small sets.

Tasks: the task text (``tasks.parquet``'s index, each episode row's ``tasks``, the
``task`` LeRobot gives every frame) is the natural-language instruction a
language-conditioned policy should see ("reach the goal position"). The suite's task
*name* (``reach-v3``, what EvalForge's policies and evaluations key on) is kept in
``meta/evalforge.json`` as ``task_names`` (text → name): keyed by text, it survives
LeRobot renumbering task indices. Episode rows use LeRobot's columns, including the
per-episode ``stats/<feature>/<stat>`` ones, plus EvalForge's ``seed`` and ``success``.

``DemonstrationDataset(path)`` reads it all back — datasets LeRobot wrote, and those
EvalForge wrote before this layout (``tasks.jsonl``, the ``evalforge`` block inside
info.json) — into per-episode state/action arrays; camera frames are decoded on demand
(``dataset.frames(episode, camera)``). It refuses a dataset with missing metadata,
dimensions that disagree with ``info.json``, or a NaN/infinity anywhere, naming the file
and the episode.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EVALFORGE_PATH = "meta/evalforge.json"
CHUNKS_SIZE = 1000  # files per chunk directory, as LeRobot
DATA_FILES_SIZE_MB = 100  # a data file is closed once it passes this size, as LeRobot
VIDEO_FILES_SIZE_MB = 200  # likewise a video file (LeRobot's default; it refuses 0)
STAT_NAMES = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
# Quantiles over more frames than this use an evenly strided subset: exact min/max/mean/std
# are cheap, exact quantiles of tens of millions of values are not, and a policy's
# normalisation bounds do not move at this precision.
QUANTILE_MAX_ROWS = 2_000_000

STATE = "observation.state"
ENV_STATE = "observation.environment_state"
ACTION = "action"
IMAGE_PREFIX = "observation.images."
ImageDtype = Literal["video", "image"]
IMAGE_DTYPES: tuple[str, ...] = ("video", "image")
SCALAR_FEATURES: dict[str, str] = {
    "next.reward": "float32",
    "next.done": "bool",
    "next.success": "bool",
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}
# LeRobot 0.6.1's VideoEncoderConfig defaults (lerobot/configs/video.py); its info block
# records them as video.g, video.crf, ... beside what the stream itself says.
VIDEO_CODEC = "libsvtav1"
VIDEO_PIX_FMT = "yuv420p"
VIDEO_ENCODER_INFO: dict[str, Any] = {"video.g": 2, "video.crf": 30, "video.preset": 12, "video.fast_decode": 0,
                                      "video.video_backend": "pyav", "video.extra_options": {}}
# The pandas release whose DataFrame.to_parquet layout meta/tasks.parquet reproduces (the one
# LeRobot 0.6.1's reference files record); written with pyarrow alone, pandas is not needed.
PANDAS_VERSION = "2.3.3"
# Linux scheduling policies that are real time (sched.h): SCHED_FIFO, SCHED_RR, SCHED_DEADLINE.
_REAL_TIME_POLICIES = (1, 2, 6)


class DatasetError(ValueError):
    """A dataset on disk that is incomplete, inconsistent or corrupt."""


# --------------------------------------------------------------------------- camera frames


@dataclass
class CameraFrames:
    """One camera's frames of one episode, already encoded the way the dataset stores them.

    ``CameraFrames.encode(frames, fps=..., dtype=...)`` makes one from ``uint8[T, H, W, 3]``
    (where the frames are rendered: the collecting worker), so that building a dataset
    only joins encoded episodes. ``histogram`` (pixel counts per channel over the frames
    LeRobot's statistics sample) gives the camera's stats without decoding again.
    """

    height: int
    width: int
    length: int
    histogram: np.ndarray  # int64 [3, 256]
    sampled: int  # frames the histogram counts
    video: bytes | None = None  # dtype "video": an AV1 mp4 of the episode
    png: list[bytes] | None = None  # dtype "image": one PNG per frame

    @property
    def dtype(self) -> str:
        return "video" if self.video is not None else "image"

    @property
    def nbytes(self) -> int:
        return len(self.video) if self.video is not None else sum(len(p) for p in self.png or ())

    @classmethod
    def encode(cls, frames: np.ndarray, *, fps: int, dtype: str = "video", threads: int = 1) -> CameraFrames:
        """Encode ``uint8[T, H, W, 3]`` frames as a video (``threads``: the encoder's) or as PNGs."""
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
            raise ValueError(f"camera frames must be uint8[T>0, H, W, 3], got {frames.dtype}{list(frames.shape)}")
        if dtype not in IMAGE_DTYPES:
            raise ValueError(f"image dtype {dtype!r} is not one of {', '.join(IMAGE_DTYPES)}")
        t, h, w, _ = frames.shape
        histogram, sampled = image_histogram(frames)
        if dtype == "video":
            return cls(h, w, t, histogram, sampled, video=encode_video(frames, fps, threads=threads))
        return cls(h, w, t, histogram, sampled, png=[encode_png(frame) for frame in frames])


def encode_video(frames: np.ndarray, fps: int, *, threads: int = 1) -> bytes:
    """An mp4 of ``uint8[T, H, W, 3]`` frames with LeRobot's encoder settings; frame i at i / fps.

    ``threads`` bounds SVT-AV1's threads (its ``lp``). SVT-AV1 moves the encoding thread
    to real-time SCHED_FIFO priority, which starves every other process on a small
    machine, so the scheduling is put back (:func:`restore_normal_scheduling`) before
    returning, whatever happened.
    """
    import av

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr at each encoder otherwise
    height, width = frames.shape[1:3]
    options = {"g": str(VIDEO_ENCODER_INFO["video.g"]), "crf": str(VIDEO_ENCODER_INFO["video.crf"]),
               "preset": str(VIDEO_ENCODER_INFO["video.preset"]),
               "svtav1-params": f"fast-decode={VIDEO_ENCODER_INFO['video.fast_decode']}:lp={max(1, threads)}"}
    buffer = io.BytesIO()
    try:
        with av.open(buffer, "w", format="mp4") as container:
            stream = container.add_stream(VIDEO_CODEC, rate=fps, options=options)
            stream.pix_fmt, stream.width, stream.height = VIDEO_PIX_FMT, width, height
            for i, frame in enumerate(frames):
                video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                video_frame.pts = i
                container.mux(stream.encode(video_frame))
            container.mux(stream.encode())
    finally:
        restore_normal_scheduling()
    return buffer.getvalue()


def restore_normal_scheduling() -> list[int]:
    """Put any thread of this process that runs at real-time priority back on SCHED_OTHER.

    Returns the thread ids it reset (empty when none was raised). Linux only: elsewhere
    there is no /proc/self/task and nothing to do.
    """
    reset: list[int] = []
    if not hasattr(os, "sched_setscheduler"):
        return reset
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        policy = int(text[text.rindex(")") + 2:].split()[38])  # field 41 of proc_pid_stat(5)
        if policy in _REAL_TIME_POLICIES:
            tid = int(stat.parent.name)
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                reset.append(tid)
            except ProcessLookupError:
                continue
    return reset


def encode_png(frame: np.ndarray) -> bytes:
    """One ``uint8[H, W, 3]`` frame as PNG bytes (PyAV's PNG encoder, lossless)."""
    import av

    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = frame.shape[1], frame.shape[0], "rgb24"
    packets = codec.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
    return b"".join(bytes(p) for p in packets)


def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes (ours or LeRobot's, written by PIL) as ``uint8[H, W, 3]``."""
    import av

    frames = av.CodecContext.create("png", "r").decode(av.Packet(data))  # a decoder per frame: it keeps state
    if len(frames) != 1:
        raise ValueError(f"expected one PNG image, decoded {len(frames)}")
    return frames[0].to_ndarray(format="rgb24")


def decode_video(path: Path | str, start_s: float, count: int, fps: float) -> np.ndarray:
    """``count`` frames of the mp4 at ``path`` from ``start_s`` on, as ``uint8[count, H, W, 3]``.

    Seeks to the keyframe before ``start_s`` (every other frame is one, ``g`` 2) and
    decodes forward; frames are placed by their timestamp, so one missing is an error.
    """
    import av

    first = round(start_s * fps)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        out = np.empty((count, stream.height, stream.width, 3), dtype=np.uint8)
        seen = np.zeros(count, dtype=bool)
        container.seek(max(0, int(start_s / stream.time_base) - 1), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            if frame.pts is None:
                continue
            k = round(float(frame.pts * stream.time_base) * fps) - first
            if k >= count:
                break
            if k >= 0:
                out[k] = frame.to_ndarray(format="rgb24")
                seen[k] = True
    if not seen.all():
        missing = int(np.flatnonzero(~seen)[0])
        raise DatasetError(f"{path}: no frame at {(first + missing) / fps:.4f} s (frame {missing} of the episode "
                           f"from {start_s:.4f} s); the video is shorter than its episodes — rewrite the dataset")
    return out


def stats_sample_indices(length: int) -> list[int]:
    """The frames of an episode LeRobot's image statistics look at (compute_stats.sample_indices)."""
    num = max(min(100, length), min(int(length ** 0.75), 10_000))
    return np.round(np.linspace(0, length - 1, num)).astype(int).tolist()


def image_histogram(frames: np.ndarray) -> tuple[np.ndarray, int]:
    """Pixel counts per channel (int64 [3, 256]) over the sampled frames, and how many were sampled.

    Frames wider or taller than 300 px are strided down to about 150 px first, as LeRobot does.
    """
    sampled = frames[stats_sample_indices(len(frames))]
    height, width = sampled.shape[1:3]
    if max(height, width) > 300:
        factor = int(max(height, width) / 150)
        sampled = sampled[:, ::factor, ::factor]
    histogram = np.stack([np.bincount(sampled[..., c].reshape(-1), minlength=256) for c in range(3)])
    return histogram.astype(np.int64), len(sampled)


# --------------------------------------------------------------------------- writer


@dataclass
class Episode:
    """One demonstration: T frames of state and action (and camera frames) for one task."""

    task: str
    state: np.ndarray  # float32 [T, D], observed before each action
    action: np.ndarray  # float32 [T, A]
    reward: np.ndarray | None = None  # float32 [T], received after each action
    success: bool = True
    seed: int | None = None
    index: int = -1  # episode_index once part of a dataset
    task_index: int = -1
    cameras: dict[str, CameraFrames] = field(default_factory=dict)  # writer input: camera → encoded frames
    environment_state: np.ndarray | None = None  # float32 [T, E]: what the policy is not shown (see ENV_STATE)

    @property
    def length(self) -> int:
        return int(self.state.shape[0])


def image_key(camera: str) -> str:
    """The feature holding a camera's frames: ``observation.images.<camera>``."""
    return IMAGE_PREFIX + camera


def write_dataset(
    root: Path | str,
    episodes: Sequence[Episode],
    *,
    fps: float,
    tasks: Mapping[str, str],
    state_names: Sequence[str] = (),
    action_names: Sequence[str] = (),
    environment_state_names: Sequence[str] = (),
    robot_type: str | None = None,
    extra_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``episodes`` under ``root`` in the LeRobot v3 layout; return the info.json contents.

    ``tasks`` maps task name → instruction (the task text LeRobot shows; the name itself
    when the instruction is empty); its order fixes ``task_index``. Every episode carries
    the same cameras, of the same size and dtype, and all or none an ``environment_state``
    (``environment_state_names`` names its values). Any previous ``data/``, ``meta/`` and
    ``videos/`` under ``root`` are replaced; ``info.json`` is written last, so a dataset
    interrupted mid-write is refused by the reader. ``extra_info`` goes to
    ``meta/evalforge.json`` beside the task names.
    """
    root = Path(root)
    task_list = list(tasks)
    if not task_list:
        raise ValueError("write_dataset: tasks must name at least one task")
    texts = [tasks[name] or name for name in task_list]
    if len(set(texts)) != len(texts):
        raise ValueError(f"write_dataset: two tasks share an instruction ({texts}); LeRobot keys tasks by their text")
    if fps != int(fps) or fps <= 0:
        raise ValueError(f"write_dataset: fps must be a positive whole number (LeRobot's info.json holds an int), "
                         f"got {fps}")
    fps = int(fps)
    task_index = {name: i for i, name in enumerate(task_list)}
    if not episodes:
        raise ValueError(f"write_dataset: no episodes to write to {root}")
    state_dim, action_dim = _episode_dims(episodes[0])
    camera_specs = {name: (c.height, c.width, c.dtype) for name, c in episodes[0].cameras.items()}
    env_dim = _env_state_dim(episodes[0])
    for i, ep in enumerate(episodes):
        if ep.task not in task_index:
            raise ValueError(f"write_dataset: episode {i} has task {ep.task!r}, not one of {task_list}")
        if _episode_dims(ep) != (state_dim, action_dim) or ep.action.shape[0] != ep.length or ep.length == 0:
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has state {list(ep.state.shape)} and "
                             f"action {list(ep.action.shape)}; expected [T>0, {state_dim}] and [T, {action_dim}]")
        if ep.reward is not None and ep.reward.shape != (ep.length,):
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has {ep.reward.shape} rewards for "
                             f"{ep.length} frames")
        if _env_state_dim(ep) != env_dim or (env_dim and ep.environment_state.shape[0] != ep.length):
            shape = None if ep.environment_state is None else list(ep.environment_state.shape)
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has environment_state {shape}; every "
                             f"episode needs {[ep.length, env_dim] if env_dim else None} (the first episode's)")
        specs = {name: (c.height, c.width, c.dtype) for name, c in ep.cameras.items()}
        if specs != camera_specs or any(c.length != ep.length for c in ep.cameras.values()):
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has cameras {specs} with "
                             f"{[c.length for c in ep.cameras.values()]} frames; every episode needs {camera_specs} "
                             f"with one frame per step ({ep.length})")

    (root / "meta" / "info.json").unlink(missing_ok=True)
    for sub in ("data", "meta", "videos"):
        shutil.rmtree(root / sub, ignore_errors=True)
    (root / "meta").mkdir(parents=True)

    features = _features(state_dim, action_dim, state_names, action_names, camera_specs,
                         env_dim=env_dim, env_names=environment_state_names)
    video_keys = [image_key(c) for c, (_, _, dtype) in camera_specs.items() if dtype == "video"]
    video_rows = _write_videos(root, episodes, video_keys, fps, features)

    frame_bytes = 4 * (state_dim + action_dim + env_dim) + 64
    episode_rows: list[dict[str, Any]] = []
    columns_seen: dict[str, list[np.ndarray]] = {}
    pending: list[pa.Table] = []
    pending_bytes = 0
    file_number = 0
    global_index = 0
    for ep_index, ep in enumerate(episodes):
        columns = _episode_columns(ep, ep_index, task_index[ep.task], global_index, fps)
        table = _frames_table(columns, ep, features)
        size = ep.length * frame_bytes + sum(c.nbytes for c in ep.cameras.values() if c.dtype == "image")
        if pending and pending_bytes + size > DATA_FILES_SIZE_MB * 1024 * 1024:
            _write_data_file(root, file_number, pending, features)
            file_number += 1
            pending, pending_bytes = [], 0
        pending.append(table)
        pending_bytes += size
        for name, values in columns.items():
            columns_seen.setdefault(name, []).append(values)
        ep_stats = {name: _stats(values) for name, values in columns.items()}
        ep_stats |= {image_key(c): _image_stats(f.histogram, f.sampled) for c, f in ep.cameras.items()}
        row: dict[str, Any] = {
            "episode_index": ep_index,
            "tasks": [texts[task_index[ep.task]]],
            "length": ep.length,
            "data/chunk_index": file_number // CHUNKS_SIZE,
            "data/file_index": file_number % CHUNKS_SIZE,
            "dataset_from_index": global_index,
            "dataset_to_index": global_index + ep.length,
            **video_rows[ep_index],
        }
        for name in features:
            for stat, value in ep_stats[name].items():
                row[f"stats/{name}/{stat}"] = value
        row |= {"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0, "seed": ep.seed,
                "success": bool(ep.success)}
        episode_rows.append(row)
        global_index += ep.length
    _write_data_file(root, file_number, pending, features)

    episodes_path = root / EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    schema = _episodes_schema(features, video_keys)
    pq.write_table(pa.Table.from_pylist(episode_rows, schema=schema), episodes_path)
    _write_tasks(root / "meta" / "tasks.parquet", texts)

    stats = {}
    for name in features:
        if name in columns_seen:
            stats[name] = _stats(np.concatenate(columns_seen[name]))
        else:  # a camera: its episodes' pixel counts add up
            camera = name.removeprefix(IMAGE_PREFIX)
            stats[name] = _image_stats(sum(ep.cameras[camera].histogram for ep in episodes),
                                       sum(ep.cameras[camera].sampled for ep in episodes))
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=4) + "\n")
    evalforge = {"task_names": {texts[i]: name for i, name in enumerate(task_list)}, **(extra_info or {})}
    (root / EVALFORGE_PATH).write_text(json.dumps(evalforge, indent=2) + "\n")

    info: dict[str, Any] = {
        "codebase_version": CODEBASE_VERSION,
        "fps": fps,
        "features": features,
        "total_episodes": len(episodes),
        "total_frames": global_index,
        "total_tasks": len(task_list),
        "chunks_size": CHUNKS_SIZE,
        "data_files_size_in_mb": DATA_FILES_SIZE_MB,
        "video_files_size_in_mb": VIDEO_FILES_SIZE_MB,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if video_keys else None,
        "robot_type": robot_type,
        "splits": {"train": f"0:{len(episodes)}"},
    }
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4) + "\n")
    return info


def _episode_dims(ep: Episode) -> tuple[int, int]:
    if ep.state.ndim != 2 or ep.action.ndim != 2:
        raise ValueError(f"write_dataset: episode of task {ep.task!r} needs 2-D state and action arrays, "
                         f"got {list(ep.state.shape)} and {list(ep.action.shape)}")
    return int(ep.state.shape[1]), int(ep.action.shape[1])


def _env_state_dim(ep: Episode) -> int:
    """The width of an episode's ``environment_state`` (0: none), refusing one that is not [T, E]."""
    if ep.environment_state is None:
        return 0
    if ep.environment_state.ndim != 2 or ep.environment_state.shape[1] == 0:
        raise ValueError(f"write_dataset: episode of task {ep.task!r} needs a 2-D environment_state [T, E], "
                         f"got {list(ep.environment_state.shape)}")
    return int(ep.environment_state.shape[1])


def _features(state_dim: int, action_dim: int, state_names: Sequence[str], action_names: Sequence[str],
              cameras: Mapping[str, tuple[int, int, str]], *, env_dim: int = 0,
              env_names: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    features: dict[str, dict[str, Any]] = {
        STATE: {"dtype": "float32", "shape": [state_dim], "names": list(state_names) or None},
    }
    if env_dim:
        if env_names and len(env_names) != env_dim:
            raise ValueError(f"write_dataset: {len(env_names)} environment_state_names for {env_dim} values")
        features[ENV_STATE] = {"dtype": "float32", "shape": [env_dim], "names": list(env_names) or None}
    features[ACTION] = {"dtype": "float32", "shape": [action_dim], "names": list(action_names) or None}
    for camera, (height, width, dtype) in cameras.items():
        features[image_key(camera)] = {"dtype": dtype, "shape": [height, width, 3],
                                       "names": ["height", "width", "channels"]}
    for name, dtype in SCALAR_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    return features


def _episode_columns(ep: Episode, ep_index: int, task_idx: int, start: int, fps: int) -> dict[str, np.ndarray]:
    n = ep.length
    frame_index = np.arange(n, dtype=np.int64)
    last = frame_index == n - 1
    reward = ep.reward if ep.reward is not None else np.zeros(n, dtype=np.float32)
    hidden = {} if ep.environment_state is None else \
        {ENV_STATE: np.ascontiguousarray(ep.environment_state, dtype=np.float32)}
    return {
        STATE: np.ascontiguousarray(ep.state, dtype=np.float32),
        **hidden,
        ACTION: np.ascontiguousarray(ep.action, dtype=np.float32),
        "next.reward": np.asarray(reward, dtype=np.float32),
        "next.done": last,
        "next.success": last & bool(ep.success),
        "timestamp": (frame_index / fps).astype(np.float32),
        "frame_index": frame_index,
        "episode_index": np.full(n, ep_index, dtype=np.int64),
        "index": start + frame_index,
        "task_index": np.full(n, task_idx, dtype=np.int64),
    }


def _frames_table(columns: Mapping[str, np.ndarray], ep: Episode, features: Mapping[str, Any]) -> pa.Table:
    arrays: dict[str, pa.Array] = {}
    for name, spec in features.items():
        if spec["dtype"] == "video":
            continue  # frames live in videos/
        if spec["dtype"] == "image":
            png = ep.cameras[name.removeprefix(IMAGE_PREFIX)].png or []
            arrays[name] = pa.StructArray.from_arrays(
                [pa.array(png, pa.binary()), pa.array([f"frame-{i:06d}.png" for i in range(len(png))], pa.string())],
                names=["bytes", "path"])
        elif columns[name].ndim == 2:
            values = columns[name]
            arrays[name] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
        else:
            arrays[name] = pa.array(columns[name])
    return pa.table(arrays)


def _hf_features(features: Mapping[str, Any]) -> dict[str, Any]:
    """The Hugging Face ``datasets`` feature description LeRobot's parquet files carry in their schema."""
    out: dict[str, Any] = {}
    for name, spec in features.items():
        if spec["dtype"] == "video":
            continue
        if spec["dtype"] == "image":
            out[name] = {"_type": "Image"}
        elif spec["shape"] == [1]:
            out[name] = {"dtype": spec["dtype"], "_type": "Value"}
        else:
            out[name] = {"feature": {"dtype": spec["dtype"], "_type": "Value"}, "length": spec["shape"][0],
                         "_type": "List"}
    return out


def _write_data_file(root: Path, file_number: int, tables: list[pa.Table], features: Mapping[str, Any]) -> None:
    """One data parquet, a row group per episode (as LeRobot), with the Hugging Face feature metadata."""
    path = root / DATA_PATH.format(chunk_index=file_number // CHUNKS_SIZE, file_index=file_number % CHUNKS_SIZE)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = tables[0].schema.with_metadata(
        {"huggingface": json.dumps({"info": {"features": _hf_features(features)}})})
    with pq.ParquetWriter(path, schema) as writer:
        for table in tables:
            writer.write_table(table.replace_schema_metadata(schema.metadata))


def _write_tasks(path: Path, texts: Sequence[str]) -> None:
    """meta/tasks.parquet as ``pandas.DataFrame({"task_index": ...}, index=texts).to_parquet()`` writes it."""
    table = pa.table({"task_index": pa.array(range(len(texts)), pa.int64()), "task": pa.array(texts, pa.string())})
    pandas_metadata = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": PANDAS_VERSION,
    }
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_metadata)}), path)


def _write_videos(root: Path, episodes: Sequence[Episode], video_keys: Sequence[str], fps: int,
                  features: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Join each video camera's episodes into files; return each episode's ``videos/...`` columns.

    Fills in the features' ``info`` blocks from the first file written (as LeRobot does).
    """
    rows: list[dict[str, Any]] = [{} for _ in episodes]
    for key in video_keys:
        camera = key.removeprefix(IMAGE_PREFIX)
        groups: list[list[int]] = [[]]
        size = 0
        for i, ep in enumerate(episodes):
            nbytes = ep.cameras[camera].nbytes
            if groups[-1] and size + nbytes > VIDEO_FILES_SIZE_MB * 1024 * 1024:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
        for file_number, group in enumerate(groups):
            chunk, file = file_number // CHUNKS_SIZE, file_number % CHUNKS_SIZE
            path = root / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
            concatenate_videos([episodes[i].cameras[camera].video or b"" for i in group], path)
            start = 0
            for i in group:
                rows[i] |= {f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                            f"videos/{key}/from_timestamp": start / fps,
                            f"videos/{key}/to_timestamp": (start + episodes[i].length) / fps}
                start += episodes[i].length
            if file_number == 0:
                features[key]["info"] = video_info(path)
    return rows


def concatenate_videos(parts: Sequence[bytes], path: Path) -> None:
    """Join mp4s of one encoder setting into ``path`` without re-encoding (LeRobot's concatenate_video_files)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="evalforge-videos-") as tmp:
        listing = Path(tmp) / "parts.ffconcat"
        lines = ["ffconcat version 1.0"]
        for i, data in enumerate(parts):
            part = Path(tmp) / f"part-{i:06d}.mp4"
            part.write_bytes(data)
            lines.append(f"file '{part}'")
        listing.write_text("\n".join(lines) + "\n")
        joined = Path(tmp) / "joined.mp4"
        with av.open(str(listing), "r", format="concat", options={"safe": "0"}) as source, \
                av.open(str(joined), "w", options={"movflags": "faststart"}) as target:
            source_stream = source.streams.video[0]
            target_stream = target.add_stream_from_template(template=source_stream, opaque=True)
            target_stream.time_base = source_stream.time_base
            for packet in source.demux(source_stream):
                if packet.dts is None:  # the demuxer's flush packet
                    continue
                packet.stream = target_stream
                target.mux(packet)
        shutil.move(joined, path)


def video_info(path: Path) -> dict[str, Any]:
    """A video feature's ``info`` block as LeRobot writes it: the stream as probed, then the encoder settings."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        info: dict[str, Any] = {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec.canonical_name,
            "video.pix_fmt": stream.pix_fmt,
            "video.fps": int(stream.base_rate),
            "video.channels": 3,
            "has_audio": bool(container.streams.audio),
        }
    return info | VIDEO_ENCODER_INFO | {"is_depth_map": False}


def _stats(values: np.ndarray) -> dict[str, list[float] | list[int]]:
    """LeRobot-style statistics of one feature, per dimension (scalars as 1-element lists)."""
    x = values.reshape(len(values), -1).astype(np.float64)
    q = x if len(x) <= QUANTILE_MAX_ROWS else x[:: math.ceil(len(x) / QUANTILE_MAX_ROWS)]
    quantiles = np.quantile(q, QUANTILES, axis=0)
    return {
        "min": x.min(axis=0).tolist(),
        "max": x.max(axis=0).tolist(),
        "mean": x.mean(axis=0).tolist(),
        "std": x.std(axis=0).tolist(),
        "count": [len(x)],
        **{f"q{round(p * 100):02d}": quantiles[i].tolist() for i, p in enumerate(QUANTILES)},
    }


def _image_stats(histogram: np.ndarray, sampled: int) -> dict[str, Any]:
    """Per-channel statistics of pixel values in [0, 1] from pixel counts, shaped (3, 1, 1) as LeRobot's.

    Exact (numpy's linear-interpolation quantiles over every sampled pixel), from the
    256-bin counts alone: uint8 pixels take no other values.
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    out: dict[str, list[Any]] = {name: [] for name in STAT_NAMES if name != "count"}
    for counts in histogram:
        n = int(counts.sum())
        cumulative = np.cumsum(counts)
        present = np.flatnonzero(counts)
        mean = float((values * counts).sum() / n)
        out["min"].append(values[present[0]])
        out["max"].append(values[present[-1]])
        out["mean"].append(mean)
        out["std"].append(float(math.sqrt(((values - mean) ** 2 * counts).sum() / n)))
        for p in QUANTILES:
            h = (n - 1) * p
            low, high = (values[np.searchsorted(cumulative, k, side="right")] for k in (math.floor(h), math.ceil(h)))
            out[f"q{round(p * 100):02d}"].append(low + (h - math.floor(h)) * (high - low))
    shaped: dict[str, Any] = {name: [[[float(v)]] for v in vs] for name, vs in out.items()}
    return {"min": shaped["min"], "max": shaped["max"], "mean": shaped["mean"], "std": shaped["std"],
            "count": [sampled], **{k: shaped[k] for k in ("q01", "q10", "q50", "q90", "q99")}}


def _episodes_schema(features: Mapping[str, Any], video_keys: Sequence[str]) -> pa.Schema:
    fields: list[tuple[str, pa.DataType]] = [
        ("episode_index", pa.int64()), ("tasks", pa.list_(pa.string())), ("length", pa.int64()),
        ("data/chunk_index", pa.int64()), ("data/file_index", pa.int64()),
        ("dataset_from_index", pa.int64()), ("dataset_to_index", pa.int64()),
    ]
    for key in video_keys:
        fields += [(f"videos/{key}/chunk_index", pa.int64()), (f"videos/{key}/file_index", pa.int64()),
                   (f"videos/{key}/from_timestamp", pa.float64()), (f"videos/{key}/to_timestamp", pa.float64())]
    for name, spec in features.items():
        value_type = pa.list_(pa.list_(pa.list_(pa.float64()))) if spec["dtype"] in IMAGE_DTYPES \
            else pa.list_(pa.float64())
        for stat in STAT_NAMES:
            fields.append((f"stats/{name}/{stat}", pa.list_(pa.int64()) if stat == "count" else value_type))
    fields += [("meta/episodes/chunk_index", pa.int64()), ("meta/episodes/file_index", pa.int64()),
               ("seed", pa.int64()), ("success", pa.bool_())]
    return pa.schema(fields)


# --------------------------------------------------------------------------- reader


class DemonstrationDataset:
    """A LeRobot v3 dataset of demonstrations on disk, read whole into per-episode arrays (named apart
    from LeRobot's own ``LeRobotDataset``, which loads the same layout lazily with torch).

    ``dataset.episodes[i]`` is an ``Episode`` with ``state`` [T, D] and ``action``
    [T, A] (float32); ``dataset.stats`` is meta/stats.json; ``dataset.tasks`` the task
    names by task_index (a suite's names where ``meta/evalforge.json`` maps the task
    texts to them, else the texts) and ``dataset.instructions`` name → task text;
    ``dataset.evalforge`` what collect-demos recorded (empty for LeRobot's datasets).
    ``dataset.cameras`` maps camera names to their features; ``dataset.frames(i, camera)``
    decodes episode ``i``'s frames of a camera, ``uint8[T, H, W, 3]``. Raises
    ``DatasetError`` naming the file (and episode) for anything missing, inconsistent
    or non-finite.
    """

    def __init__(self, path: Path | str) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise DatasetError(f"{self.root}: no such dataset directory")
        self.info = self._read_info()
        features = self.info["features"]
        self.fps = float(self.info["fps"])
        self.state_dim = _feature_dim(features, STATE, self.root / "meta/info.json")
        self.action_dim = _feature_dim(features, ACTION, self.root / "meta/info.json")
        self.environment_state_dim = _feature_dim(features, ENV_STATE, self.root / "meta/info.json") \
            if ENV_STATE in features else 0
        """Width of ``observation.environment_state`` (0: the dataset has none)."""
        self.cameras = self._read_cameras(features)
        self.evalforge = self._read_evalforge()
        self.tasks, self.instructions = self._read_tasks()
        self.stats = self._read_stats()
        self._rows = self._read_episode_rows()
        self.episodes = self._read_data(self._rows)
        total_frames = sum(ep.length for ep in self.episodes)
        if len(self.episodes) != self.info["total_episodes"] or total_frames != self.info["total_frames"]:
            raise DatasetError(
                f"{self.root / 'meta/info.json'}: says {self.info['total_episodes']} episodes and "
                f"{self.info['total_frames']} frames, the data holds {len(self.episodes)} and {total_frames}; "
                "the dataset was modified or partly written — rewrite it")

    def __len__(self) -> int:
        return len(self.episodes)

    def __getitem__(self, index: int) -> Episode:
        return self.episodes[index]

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes)

    @property
    def num_frames(self) -> int:
        return sum(ep.length for ep in self.episodes)

    def frames(self, episode: int, camera: str) -> np.ndarray:
        """Episode ``episode``'s frames from ``camera`` (its name or its feature key): ``uint8[T, H, W, 3]``."""
        name = camera.removeprefix(IMAGE_PREFIX)
        if name not in self.cameras:
            raise DatasetError(f"{self.root}: no camera {camera!r}; the dataset has "
                               f"{', '.join(self.cameras) or 'no cameras'}")
        if not 0 <= episode < len(self.episodes):
            raise DatasetError(f"{self.root}: no episode {episode}; it has 0..{len(self.episodes) - 1}")
        key, spec, row = image_key(name), self.cameras[name], self._rows[episode]
        length = row["length"]
        where = f"{self.root}, episode {episode}, camera {name}"
        if spec["dtype"] == "video":
            location = [row.get(f"videos/{key}/{k}") for k in ("chunk_index", "file_index", "from_timestamp")]
            if any(v is None for v in location):
                raise DatasetError(f"{where}: the episode metadata has no videos/{key}/... columns")
            chunk, file, start = location
            path = self.root / (self.info.get("video_path") or VIDEO_PATH).format(
                video_key=key, chunk_index=chunk, file_index=file)
            if not path.is_file():
                raise DatasetError(f"{path}: video file missing ({where} points to it)")
            frames = decode_video(path, float(start), length, self.fps)
        else:
            path = self.root / self.info["data_path"].format(chunk_index=row["data/chunk_index"],
                                                             file_index=row["data/file_index"])
            table = pq.read_table(path, columns=["episode_index", key], filters=[("episode_index", "==", episode)])
            images = table.column(key).to_pylist()
            try:
                frames = np.stack([decode_png(image["bytes"]) for image in images]) if images else None
            except (ValueError, TypeError, KeyError) as e:
                raise DatasetError(f"{path}, episode {episode}: '{key}' holds an unreadable image ({e})") from None
            if frames is None or len(frames) != length:
                raise DatasetError(f"{path}, episode {episode}: {len(images)} '{key}' images for {length} frames")
        expected = tuple(spec["shape"])
        if frames.shape[1:] != expected:
            raise DatasetError(f"{where}: frames are {list(frames.shape[1:])}, info.json says {list(expected)}")
        return frames

    def _meta(self, rel: str) -> Path:
        path = self.root / rel
        if not path.is_file():
            raise DatasetError(f"{path}: missing; {self.root} is not a complete LeRobot v3 dataset "
                               "(re-run the command that wrote it, e.g. `trainer collect-demos`)")
        return path

    def _read_json(self, rel: str) -> Any:
        path = self._meta(rel)
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})") from None

    def _read_info(self) -> dict[str, Any]:
        info = self._read_json("meta/info.json")
        path = self.root / "meta/info.json"
        if not isinstance(info, dict):
            raise DatasetError(f"{path}: must hold a JSON object")
        version = str(info.get("codebase_version", ""))
        if not version.startswith("v3."):
            raise DatasetError(f"{path}: codebase_version is {version or 'missing'}, this reader needs v3.x; "
                               "convert the dataset with LeRobot's v2.1→v3.0 converter")
        for key in ("fps", "features", "total_episodes", "total_frames", "data_path"):
            if key not in info:
                raise DatasetError(f"{path}: missing the '{key}' field")
        return info

    def _read_cameras(self, features: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        cameras: dict[str, dict[str, Any]] = {}
        for key, spec in features.items():
            if isinstance(spec, dict) and spec.get("dtype") in IMAGE_DTYPES:
                shape = spec.get("shape")
                if not (isinstance(shape, list) and len(shape) == 3 and shape[2] == 3):
                    raise DatasetError(f"{self.root / 'meta/info.json'}: features['{key}'] must have a shape "
                                       f"[height, width, 3], got {shape!r}")
                cameras[key.removeprefix(IMAGE_PREFIX)] = spec
        return cameras

    def _read_evalforge(self) -> dict[str, Any]:
        """meta/evalforge.json; datasets written before it kept the same under info.json's "evalforge"."""
        if (self.root / EVALFORGE_PATH).is_file():
            data = self._read_json(EVALFORGE_PATH)
            if not isinstance(data, dict):
                raise DatasetError(f"{self.root / EVALFORGE_PATH}: must hold a JSON object")
            return data
        return dict(self.info.get("evalforge") or {})

    def _read_tasks(self) -> tuple[list[str], dict[str, str]]:
        """Task names by task_index and name → text: tasks.parquet (LeRobot's) first, else tasks.jsonl (ours, older)."""
        if (self.root / "meta/tasks.parquet").is_file() or not (self.root / "meta/tasks.jsonl").is_file():
            texts = self._read_tasks_parquet()
            names = self.evalforge.get("task_names") or {}
            tasks = [str(names.get(text, text)) for text in texts]
            if len(set(tasks)) != len(tasks):
                raise DatasetError(f"{self.root / EVALFORGE_PATH}: task_names gives two task texts one name: {names}")
            return tasks, dict(zip(tasks, texts, strict=True))
        path = self._meta("meta/tasks.jsonl")
        by_index: dict[int, dict[str, Any]] = {}
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                by_index[int(row["task_index"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise DatasetError(f"{path}:{line_no}: expected {{\"task_index\": int, \"task\": str}}, "
                                   f"got {line[:80]!r}") from None
        if sorted(by_index) != list(range(len(by_index))) or not by_index:
            raise DatasetError(f"{path}: task_index values must be 0..N-1, got {sorted(by_index)}")
        tasks = [str(by_index[i]["task"]) for i in range(len(by_index))]
        return tasks, {t: str(by_index[i].get("instruction", t)) for i, t in enumerate(tasks)}

    def _read_tasks_parquet(self) -> list[str]:
        """LeRobot's ``meta/tasks.parquet``: the task texts by ``task_index`` (the text is the pandas index)."""
        path = self._meta("meta/tasks.parquet")
        try:
            table = pq.read_table(path).to_pydict()
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: unreadable parquet ({e})") from None
        text_column = next((c for c in ("task", "__index_level_0__") if c in table), None)
        if text_column is None or "task_index" not in table:
            raise DatasetError(f"{path}: expected a task_index column and the task text (column 'task' or the "
                               f"pandas index), got columns {sorted(table)}")
        by_index = {int(i): str(t) for i, t in zip(table["task_index"], table[text_column], strict=True)}
        if sorted(by_index) != list(range(len(by_index))) or not by_index:
            raise DatasetError(f"{path}: task_index values must be 0..N-1, got {sorted(by_index)}")
        return [by_index[i] for i in range(len(by_index))]

    def _read_stats(self) -> dict[str, Any]:
        stats = self._read_json("meta/stats.json")
        path = self.root / "meta/stats.json"
        for feature, dim in ((STATE, self.state_dim), (ACTION, self.action_dim)):
            entry = stats.get(feature) if isinstance(stats, dict) else None
            if not isinstance(entry, dict):
                raise DatasetError(f"{path}: no statistics for '{feature}'")
            for name in ("min", "max", "mean", "std"):
                if len(entry.get(name) or []) != dim:
                    raise DatasetError(f"{path}: '{feature}' {name} has {len(entry.get(name) or [])} values, "
                                       f"info.json says {dim} dimensions")
        return stats

    def _read_episode_rows(self) -> list[dict[str, Any]]:
        episodes_dir = self.root / "meta/episodes"
        files = sorted(episodes_dir.glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(f"{episodes_dir}: no episode metadata (chunk-*/file-*.parquet); "
                               f"{self.root} is not a complete LeRobot v3 dataset")
        rows: list[dict[str, Any]] = []
        for path in files:
            try:
                table = pq.read_table(path)
                keep = [c for c in table.column_names if not c.startswith("stats/")]
                rows.extend(table.select(keep).to_pylist())
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{path}: unreadable episode metadata ({e})") from None
        required = ("episode_index", "length", "data/chunk_index", "data/file_index")
        for row in rows:
            missing = [k for k in required if row.get(k) is None]
            if missing:
                raise DatasetError(f"{files[0].parent}: episode {row.get('episode_index')} metadata lacks {missing}")
        rows.sort(key=lambda r: r["episode_index"])
        if [r["episode_index"] for r in rows] != list(range(len(rows))):
            raise DatasetError(f"{episodes_dir}: episode indices must be 0..N-1 without gaps")
        return rows

    def _read_data(self, rows: list[dict[str, Any]]) -> list[Episode]:
        by_file: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for row in rows:
            by_file.setdefault((row["data/chunk_index"], row["data/file_index"]), []).append(row)
        episodes: list[Episode] = []
        for (chunk, file), file_rows in sorted(by_file.items()):
            path = self.root / self.info["data_path"].format(chunk_index=chunk, file_index=file)
            episodes.extend(self._read_data_file(path, file_rows))
        episodes.sort(key=lambda ep: ep.index)
        return episodes

    def _read_data_file(self, path: Path, rows: list[dict[str, Any]]) -> list[Episode]:
        if not path.is_file():
            raise DatasetError(f"{path}: data file missing (episodes "
                               f"{[r['episode_index'] for r in rows]} point to it)")
        try:
            names = pq.read_schema(path).names
            wanted = [c for c in (STATE, ACTION, "episode_index", "frame_index", "task_index", "next.reward",
                                  ENV_STATE) if c in names]  # camera images stay on disk until frames() asks
            table = pq.read_table(path, columns=wanted)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: unreadable parquet ({e})") from None
        required = (STATE, ACTION, "episode_index", "frame_index", *((ENV_STATE,) if self.environment_state_dim else ()))
        for column in required:
            if column not in table.column_names:
                raise DatasetError(f"{path}: no '{column}' column")
        ep_col = table.column("episode_index").to_numpy()
        frame_col = table.column("frame_index").to_numpy()
        reward_col = table.column("next.reward").to_numpy() if "next.reward" in table.column_names else None
        task_col = table.column("task_index").to_numpy() if "task_index" in table.column_names else None
        out: list[Episode] = []
        for row in rows:
            ep_index = row["episode_index"]
            where = f"{path}, episode {ep_index}"
            idx = np.flatnonzero(ep_col == ep_index)
            if len(idx) != row["length"]:
                raise DatasetError(f"{where}: {len(idx)} frames, the episode metadata says {row['length']}")
            if not np.array_equal(frame_col[idx], np.arange(len(idx))):
                raise DatasetError(f"{where}: frame_index is not 0..{len(idx) - 1} in order")
            state = _matrix(table.column(STATE).take(pa.array(idx)), self.state_dim, STATE, where)
            action = _matrix(table.column(ACTION).take(pa.array(idx)), self.action_dim, ACTION, where)
            reward = None if reward_col is None else reward_col[idx].astype(np.float32)
            hidden = _matrix(table.column(ENV_STATE).take(pa.array(idx)), self.environment_state_dim, ENV_STATE,
                             where) if self.environment_state_dim else None
            for name, values in ((STATE, state), (ACTION, action), ("next.reward", reward), (ENV_STATE, hidden)):
                if values is not None and not np.isfinite(values).all():
                    frame = int(np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))[0])
                    raise DatasetError(f"{where}: '{name}' has NaN or infinity at frame {frame}; "
                                       "drop the episode or re-collect it")
            task_index = self._episode_task(row, None if task_col is None else task_col[idx], where)
            out.append(Episode(task=self.tasks[task_index], state=state, action=action, reward=reward,
                               success=bool(row.get("success", True)), seed=row.get("seed"),
                               index=ep_index, task_index=task_index, environment_state=hidden))
        return out

    def _episode_task(self, row: Mapping[str, Any], frame_tasks: np.ndarray | None, where: str) -> int:
        """The episode's task_index: its frames' (LeRobot keeps them right through its edits), else its row's."""
        if frame_tasks is not None and len(frame_tasks):
            if (frame_tasks != frame_tasks[0]).any():
                raise DatasetError(f"{where}: frames of several tasks ({sorted(set(frame_tasks.tolist()))}); "
                                   "this reader trains one task per episode — split the episode")
            task_index = int(frame_tasks[0])
        else:
            text = (row.get("tasks") or [None])[0]
            texts = [self.instructions.get(t, t) for t in self.tasks]
            task_index = self.tasks.index(text) if text in self.tasks else texts.index(text) if text in texts else -1
        if not 0 <= task_index < len(self.tasks):
            raise DatasetError(f"{where}: task_index {task_index} is not in the dataset's tasks "
                               f"(0..{len(self.tasks) - 1})")
        return task_index


def _feature_dim(features: Any, name: str, path: Path) -> int:
    spec = features.get(name) if isinstance(features, dict) else None
    shape = spec.get("shape") if isinstance(spec, dict) else None
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 0):
        raise DatasetError(f"{path}: features['{name}'] must have a shape [n], got {spec!r}")
    return shape[0]


def _matrix(column: pa.ChunkedArray, dim: int, name: str, where: str) -> np.ndarray:
    """A list-valued column as a float32 [T, dim] array, refusing rows of another length."""
    chunk = column.combine_chunks()
    if not pa.types.is_list(chunk.type) and not pa.types.is_fixed_size_list(chunk.type) \
            and not pa.types.is_large_list(chunk.type):
        raise DatasetError(f"{where}: '{name}' must be a list column, got {chunk.type}")
    if chunk.null_count:
        frame = int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
        raise DatasetError(f"{where}: '{name}' is null at frame {frame}")
    lengths = chunk.value_lengths().to_numpy(zero_copy_only=False)
    if len(chunk) and (lengths != dim).any():
        frame = int(np.flatnonzero(lengths != dim)[0])
        raise DatasetError(f"{where}: '{name}' has {int(lengths[frame])} values at frame {frame}, "
                           f"info.json says {dim}")
    return chunk.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(chunk), dim)
