"""Robot demonstration datasets in the LeRobot v3.0 layout: the writer and the reader.

Layout (``codebase_version`` "v3.0")::

    meta/info.json                              fps, features (dtype/shape/names), totals, path templates
    meta/stats.json                             per feature: min, max, mean, std, count, q01, q10, q50, q90, q99
    meta/tasks.jsonl                            {"task_index", "task", "instruction"} per line
    meta/episodes/chunk-000/file-000.parquet    one row per episode (see below)
    data/chunk-000/file-000.parquet             one row per frame, episodes whole and in order

Frame columns: ``observation.state`` (float32 [D]), ``action`` (float32 [A], the action
applied after observing the state), ``next.reward`` (float32), ``next.done`` and
``next.success`` (bool, true on the last frame of an episode / of a successful one),
``timestamp`` (float32 seconds, ``frame_index / fps``), ``frame_index``,
``episode_index``, ``index`` (global frame index) and ``task_index`` (int64).

Episode rows use LeRobot v3's column names — ``episode_index``, ``tasks``,
``length``, ``data/chunk_index``, ``data/file_index``, ``dataset_from_index``,
``dataset_to_index``, ``meta/episodes/chunk_index``, ``meta/episodes/file_index`` —
plus EvalForge's ``task_index``, ``seed`` and ``success``. Two deliberate
departures from LeRobot's own writer (the reader accepts both): tasks live in ``meta/tasks.jsonl`` (LeRobot
v3 keeps a ``tasks.parquet`` whose pandas index is the task text, which cannot
be written without pandas), and episode rows carry no per-episode stats columns.
A task is the task *name* a policy sees in its observation (``reach-v3``); its
natural-language instruction sits beside it in ``tasks.jsonl``.

``DemonstrationDataset(path)`` reads it all back into per-episode arrays and refuses a
dataset with missing metadata, dimensions that disagree with ``info.json``, or a
NaN/infinity anywhere, naming the file and the episode.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
CHUNKS_SIZE = 1000  # files per chunk directory, as LeRobot
DATA_FILES_SIZE_MB = 100  # a data file is closed once it passes this size, as LeRobot
STAT_NAMES = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
# Quantiles over more frames than this use an evenly strided subset: exact min/max/mean/std
# are cheap, exact quantiles of tens of millions of values are not, and a policy's
# normalisation bounds do not move at this precision.
QUANTILE_MAX_ROWS = 2_000_000

STATE = "observation.state"
ACTION = "action"
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


class DatasetError(ValueError):
    """A dataset on disk that is incomplete, inconsistent or corrupt."""


@dataclass
class Episode:
    """One demonstration: T frames of state and action for one task."""

    task: str
    state: np.ndarray  # float32 [T, D], observed before each action
    action: np.ndarray  # float32 [T, A]
    reward: np.ndarray | None = None  # float32 [T], received after each action
    success: bool = True
    seed: int | None = None
    index: int = -1  # episode_index once part of a dataset
    task_index: int = -1

    @property
    def length(self) -> int:
        return int(self.state.shape[0])


# --------------------------------------------------------------------------- writer


def write_dataset(
    root: Path | str,
    episodes: Sequence[Episode],
    *,
    fps: float,
    tasks: Mapping[str, str],
    state_names: Sequence[str] = (),
    action_names: Sequence[str] = (),
    robot_type: str | None = None,
    extra_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``episodes`` under ``root`` in the LeRobot v3 layout; return the info.json contents.

    ``tasks`` maps task name → instruction; its order fixes ``task_index``. Any
    previous ``data/`` and ``meta/`` under ``root`` are replaced; ``info.json`` is
    written last, so a dataset interrupted mid-write is refused by the reader.
    ``extra_info`` is stored under the ``"evalforge"`` key of info.json.
    """
    root = Path(root)
    task_list = list(tasks)
    if not task_list:
        raise ValueError("write_dataset: tasks must name at least one task")
    task_index = {name: i for i, name in enumerate(task_list)}
    if not episodes:
        raise ValueError(f"write_dataset: no episodes to write to {root}")
    state_dim, action_dim = _episode_dims(episodes[0])
    for i, ep in enumerate(episodes):
        if ep.task not in task_index:
            raise ValueError(f"write_dataset: episode {i} has task {ep.task!r}, not one of {task_list}")
        if _episode_dims(ep) != (state_dim, action_dim) or ep.action.shape[0] != ep.length or ep.length == 0:
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has state {list(ep.state.shape)} and "
                             f"action {list(ep.action.shape)}; expected [T>0, {state_dim}] and [T, {action_dim}]")
        if ep.reward is not None and ep.reward.shape != (ep.length,):
            raise ValueError(f"write_dataset: episode {i} ({ep.task}) has {ep.reward.shape} rewards for "
                             f"{ep.length} frames")

    (root / "meta" / "info.json").unlink(missing_ok=True)
    for sub in ("data", "meta"):
        shutil.rmtree(root / sub, ignore_errors=True)
    (root / "meta").mkdir(parents=True)

    features = _features(state_dim, action_dim, state_names, action_names)
    bytes_per_frame = 4 * (state_dim + action_dim) + 64
    frames_per_file = max(1, DATA_FILES_SIZE_MB * 1024 * 1024 // bytes_per_frame)

    episode_rows: list[dict[str, Any]] = []
    columns: dict[str, list[np.ndarray]] = {name: [] for name in features}
    pending: list[dict[str, np.ndarray]] = []
    pending_frames = 0
    file_number = 0
    global_index = 0
    for ep_index, ep in enumerate(episodes):
        frames = _episode_columns(ep, ep_index, task_index[ep.task], global_index, fps)
        if pending and pending_frames + ep.length > frames_per_file:
            _write_data_file(root, file_number, pending, features)
            file_number += 1
            pending, pending_frames = [], 0
        pending.append(frames)
        pending_frames += ep.length
        for name in features:
            columns[name].append(frames[name])
        episode_rows.append({
            "episode_index": ep_index,
            "tasks": [ep.task],
            "length": ep.length,
            "data/chunk_index": file_number // CHUNKS_SIZE,
            "data/file_index": file_number % CHUNKS_SIZE,
            "dataset_from_index": global_index,
            "dataset_to_index": global_index + ep.length,
            "meta/episodes/chunk_index": 0,
            "meta/episodes/file_index": 0,
            "task_index": task_index[ep.task],
            "seed": ep.seed,
            "success": bool(ep.success),
        })
        global_index += ep.length
    _write_data_file(root, file_number, pending, features)

    episodes_path = root / EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(episode_rows, schema=_EPISODES_SCHEMA), episodes_path)

    with open(root / "meta" / "tasks.jsonl", "w") as f:
        for name in task_list:
            f.write(json.dumps({"task_index": task_index[name], "task": name, "instruction": tasks[name]}) + "\n")

    stats = {name: _stats(np.concatenate(parts)) for name, parts in columns.items()}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")

    info: dict[str, Any] = {
        "codebase_version": CODEBASE_VERSION,
        "robot_type": robot_type,
        "total_episodes": len(episodes),
        "total_frames": global_index,
        "total_tasks": len(task_list),
        "chunks_size": CHUNKS_SIZE,
        "data_files_size_in_mb": DATA_FILES_SIZE_MB,
        "video_files_size_in_mb": 0,
        "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"},
        "data_path": DATA_PATH,
        "video_path": None,
        "features": features,
    }
    if extra_info:
        info["evalforge"] = dict(extra_info)
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


_EPISODES_SCHEMA = pa.schema([
    ("episode_index", pa.int64()),
    ("tasks", pa.list_(pa.string())),
    ("length", pa.int64()),
    ("data/chunk_index", pa.int64()),
    ("data/file_index", pa.int64()),
    ("dataset_from_index", pa.int64()),
    ("dataset_to_index", pa.int64()),
    ("meta/episodes/chunk_index", pa.int64()),
    ("meta/episodes/file_index", pa.int64()),
    ("task_index", pa.int64()),
    ("seed", pa.int64()),
    ("success", pa.bool_()),
])


def _episode_dims(ep: Episode) -> tuple[int, int]:
    if ep.state.ndim != 2 or ep.action.ndim != 2:
        raise ValueError(f"write_dataset: episode of task {ep.task!r} needs 2-D state and action arrays, "
                         f"got {list(ep.state.shape)} and {list(ep.action.shape)}")
    return int(ep.state.shape[1]), int(ep.action.shape[1])


def _features(state_dim: int, action_dim: int, state_names: Sequence[str],
              action_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    features: dict[str, dict[str, Any]] = {
        STATE: {"dtype": "float32", "shape": [state_dim], "names": list(state_names) or None},
        ACTION: {"dtype": "float32", "shape": [action_dim], "names": list(action_names) or None},
    }
    for name, dtype in SCALAR_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    return features


def _episode_columns(ep: Episode, ep_index: int, task_idx: int, start: int,
                     fps: float) -> dict[str, np.ndarray]:
    n = ep.length
    frame_index = np.arange(n, dtype=np.int64)
    last = frame_index == n - 1
    reward = ep.reward if ep.reward is not None else np.zeros(n, dtype=np.float32)
    return {
        STATE: np.ascontiguousarray(ep.state, dtype=np.float32),
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


def _arrow_column(values: np.ndarray) -> pa.Array:
    if values.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    return pa.array(values)


def _write_data_file(root: Path, file_number: int, parts: list[dict[str, np.ndarray]],
                     features: Mapping[str, Any]) -> None:
    path = root / DATA_PATH.format(chunk_index=file_number // CHUNKS_SIZE, file_index=file_number % CHUNKS_SIZE)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: _arrow_column(np.concatenate([p[name] for p in parts])) for name in features})
    pq.write_table(table, path)


def _stats(values: np.ndarray) -> dict[str, list[float] | list[int]]:
    """LeRobot-style statistics of one feature, per dimension (scalars as 1-element lists)."""
    x = values.reshape(len(values), -1).astype(np.float64)
    q = x if len(x) <= QUANTILE_MAX_ROWS else x[:: math.ceil(len(x) / QUANTILE_MAX_ROWS)]
    quantiles = np.quantile(q, [0.01, 0.10, 0.50, 0.90, 0.99], axis=0)
    return {
        "min": x.min(axis=0).tolist(),
        "max": x.max(axis=0).tolist(),
        "mean": x.mean(axis=0).tolist(),
        "std": x.std(axis=0).tolist(),
        "count": [len(x)],
        "q01": quantiles[0].tolist(),
        "q10": quantiles[1].tolist(),
        "q50": quantiles[2].tolist(),
        "q90": quantiles[3].tolist(),
        "q99": quantiles[4].tolist(),
    }


# --------------------------------------------------------------------------- reader


class DemonstrationDataset:
    """A LeRobot v3 dataset of demonstrations on disk, read whole into per-episode arrays (named apart
    from LeRobot's own ``LeRobotDataset``, which loads the same layout lazily with torch).

    ``dataset.episodes[i]`` is an ``Episode`` with ``state`` [T, D] and ``action``
    [T, A] (float32); ``dataset.stats`` is meta/stats.json; ``dataset.tasks`` the
    task names by task_index and ``dataset.instructions`` their instructions.
    Raises ``DatasetError`` naming the file (and episode) for anything missing,
    inconsistent or non-finite.
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
        self.tasks, self.instructions = self._read_tasks()
        self.stats = self._read_stats()
        rows = self._read_episode_rows()
        self.episodes = self._read_data(rows)
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

    def _read_tasks(self) -> tuple[list[str], dict[str, str]]:
        if not (self.root / "meta/tasks.jsonl").is_file() and (self.root / "meta/tasks.parquet").is_file():
            return self._read_tasks_parquet()
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

    def _read_tasks_parquet(self) -> tuple[list[str], dict[str, str]]:
        """LeRobot's own v3 writer: ``meta/tasks.parquet``, task text as the pandas index, plus ``task_index``."""
        import pyarrow.parquet as pq

        path = self.root / "meta/tasks.parquet"
        table = pq.read_table(path).to_pydict()
        text_column = next((c for c in ("task", "__index_level_0__") if c in table), None)
        if text_column is None or "task_index" not in table:
            raise DatasetError(f"{path}: expected a task_index column and the task text (column 'task' or the "
                               f"pandas index), got columns {sorted(table)}")
        by_index = {int(i): str(t) for i, t in zip(table["task_index"], table[text_column], strict=True)}
        if sorted(by_index) != list(range(len(by_index))) or not by_index:
            raise DatasetError(f"{path}: task_index values must be 0..N-1, got {sorted(by_index)}")
        tasks = [by_index[i] for i in range(len(by_index))]
        return tasks, {t: t for t in tasks}  # LeRobot's task text is its instruction

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
                rows.extend(pq.read_table(path).to_pylist())
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
            table = pq.read_table(path)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: unreadable parquet ({e})") from None
        for column in (STATE, ACTION, "episode_index", "frame_index"):
            if column not in table.column_names:
                raise DatasetError(f"{path}: no '{column}' column")
        ep_col = table.column("episode_index").to_numpy()
        frame_col = table.column("frame_index").to_numpy()
        reward_col = table.column("next.reward").to_numpy() if "next.reward" in table.column_names else None
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
            for name, values in ((STATE, state), (ACTION, action), ("next.reward", reward)):
                if values is not None and not np.isfinite(values).all():
                    frame = int(np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))[0])
                    raise DatasetError(f"{where}: '{name}' has NaN or infinity at frame {frame}; "
                                       "drop the episode or re-collect it")
            tasks = row.get("tasks") or []
            task_index = row.get("task_index")
            if task_index is None:
                task_index = self.tasks.index(tasks[0]) if tasks and tasks[0] in self.tasks else -1
            if not 0 <= task_index < len(self.tasks):
                raise DatasetError(f"{where}: task {tasks or task_index!r} is not in meta/tasks.jsonl")
            out.append(Episode(task=self.tasks[task_index], state=state, action=action, reward=reward,
                               success=bool(row.get("success", True)), seed=row.get("seed"),
                               index=ep_index, task_index=task_index))
        return out


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
