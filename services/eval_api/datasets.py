"""An evaluation's recorded rollouts as one LeRobot v3 dataset: ``GET /evaluations/{id}/dataset``.

Workers write each recorded episode to its own file under ``ARTIFACT_ROOT``
(``services/workers/recording.py``; ``episodes.recording_path`` names it). Here the files of one
evaluation are joined, in episode-index order, into a LeRobot v3 dataset (``lerobot_format``:
``meta/``, ``data/``, ``videos/`` — the layout ``trainer vla`` trains on and LeRobot's
``LeRobotDataset`` loads). Videos were encoded by the workers, so joining only remuxes them.

The dataset is built on request, from the recordings present at that moment (an evaluation still
running gives the episodes recorded so far), into a temporary directory, and sent as an uncompressed
tar (parquet and AV1 are compressed already) whose members are the dataset's own paths; the
directory is removed once sent. ``meta/evalforge.json`` names where the data came from: the suite,
the evaluation, its record mode, the policy and the recorded episodes' indices.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lerobot_format import DatasetError, Episode, write_dataset
from lerobot_format.episode_file import load_episode
from services.store.models import Episode as EpisodeRow
from services.store.models import Evaluation


class NoRecordings(LookupError):
    """The evaluation has no recorded episode (yet)."""


def load_recordings(artifact_root: Path, rows: Sequence[EpisodeRow]) -> list[tuple[int, Episode, dict[str, Any]]]:
    """(episode index, episode, meta) of each row's recording, in index order; ``DatasetError`` naming a
    file that is missing or outside ``artifact_root``."""
    root = artifact_root.resolve()
    out = []
    for row in sorted(rows, key=lambda r: r.episode_index):
        if not row.recording_path:
            continue
        path = (root / row.recording_path).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise DatasetError(f"episode {row.episode_index}'s recording {row.recording_path!r} is not a file under "
                               f"ARTIFACT_ROOT {str(root)!r}: the API's ARTIFACT_ROOT must name the same directory "
                               "(volume) as the workers'")
        episode, meta = load_episode(path)
        out.append((row.episode_index, episode, meta))
    return out


def build_dataset(out: Path, evaluation: Evaluation, rows: Sequence[EpisodeRow], artifact_root: Path) -> dict[str, Any]:
    """Write the LeRobot dataset of ``evaluation``'s recorded ``rows`` to ``out``; its info.json contents.
    ``NoRecordings`` when none of the rows has a recording."""
    recordings = load_recordings(artifact_root, rows)
    if not recordings:
        raise NoRecordings(f"evaluation {evaluation.id} has no recorded episodes (its record mode is "
                           f"{evaluation.record!r}); submit one with `record` first, failures or all "
                           "(`evalforge eval submit ... --record failures`)")
    first_meta = recordings[0][2]
    present = {episode.task for _, episode, _ in recordings}
    instructions = {episode.task: meta.get("instruction") or "" for _, episode, meta in recordings}
    tasks = {task: instructions[task] for task in [*evaluation.tasks, *sorted(present)] if task in present}
    policy = evaluation.policy
    return write_dataset(
        out, [episode for _, episode, _ in recordings], fps=first_meta["fps"], tasks=tasks,
        state_names=first_meta.get("state_names") or (), action_names=first_meta.get("action_names") or (),
        robot_type=first_meta.get("robot_type"),
        extra_info={
            "suite": evaluation.suite,
            "created_by": "evalforge evaluation recording",
            "evaluation_id": evaluation.id,
            "record": evaluation.record,
            "definition_hash": evaluation.definition_hash,
            "policy": {"id": policy.id, "name": policy.name, "version": policy.version,
                       "checkpoint_sha256": policy.checkpoint_sha256, "revision": policy.revision},
            "cameras": evaluation.cameras or {},
            "episode_indices": [index for index, _, _ in recordings],
        })


def dataset_tar(evaluation: Evaluation, rows: Sequence[EpisodeRow], artifact_root: Path) -> tuple[Path, Path]:
    """Build the dataset in a new temporary directory and tar it there; (tar file, directory to remove)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"evalforge-dataset-{evaluation.id}-"))
    try:
        root = scratch / "dataset"
        build_dataset(root, evaluation, rows, artifact_root)
        tar_path = scratch / "dataset.tar"
        with tarfile.open(tar_path, "w") as tar:
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
        shutil.rmtree(root)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return tar_path, scratch
