"""Demonstration video benchmark: frames/s written and read at 96 px (2 cameras), dataset size vs raw frames.

What ``trainer collect-demos --cameras corner,gripper --image-size 96`` pays for its
frames, on real MetaWorld renders (reach, the scripted expert's episodes):

- encode: frames/s of ``CameraFrames.encode`` (AV1 via PyAV's libsvtav1, LeRobot's
  settings, one encoder thread — what each collecting worker does), and of PNG for
  ``--image-dtype image``;
- write: frames/s of ``write_dataset`` joining the encoded episodes into the LeRobot
  layout (no re-encoding);
- read: frames/s of ``DemonstrationDataset.frames`` decoding every episode back;
- size: bytes on disk per frame against raw ``uint8`` frames (H × W × 3).

    .venv/bin/python bench/video_codec.py [--episodes 4] [--size 96]

Rendering is not counted (bench/ has its own render benchmark); frames are rendered
once, up front. Prints one table per dtype.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.registry import get_suite
from trainer.data.lerobot import CameraFrames, DemonstrationDataset, Episode, write_dataset

SUITE, TASK, CAMERAS = "metaworld-mt1-reach", "reach-v3", ("corner", "gripper")


def render_episodes(n: int, size: int) -> list[tuple[Episode, dict[str, np.ndarray]]]:
    """n expert episodes with their frames, uint8 [T, size, size, 3] per camera."""
    suite = get_suite(SUITE)
    expert = suite.expert(TASK)
    out = []
    with suite.make_env(TASK, 0) as env:
        for seed in range(n):
            env.reset(seed)
            states, actions, frames = [], [], {c: [] for c in CAMERAS}
            while True:
                for camera, image in env.render_images({c: (size, size) for c in CAMERAS}).items():
                    frames[camera].append(image)
                states.append(env.expert_observation()["state"])
                result = env.step(expert(env.expert_observation()))
                actions.append(result.info["action"])
                if result.done:
                    break
            out.append((Episode(task=TASK, state=np.stack(states), action=np.stack(actions), seed=seed),
                        {c: np.stack(f) for c, f in frames.items()}))
    return out


def run(episodes: list[tuple[Episode, dict[str, np.ndarray]]], dtype: str, fps: int) -> dict[str, float]:
    frames_total = sum(len(f) for _, cams in episodes for f in cams.values())
    raw_bytes = sum(f.nbytes for _, cams in episodes for f in cams.values())
    started = time.perf_counter()
    for ep, cams in episodes:
        ep.cameras = {c: CameraFrames.encode(f, fps=fps, dtype=dtype) for c, f in cams.items()}
    encode_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        started = time.perf_counter()
        write_dataset(root, [ep for ep, _ in episodes], fps=fps, tasks={TASK: "reach the goal position"})
        write_s = time.perf_counter() - started
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        image_bytes = sum(p.stat().st_size for p in root.rglob("*.mp4")) if dtype == "video" else \
            sum(c.nbytes for ep, _ in episodes for c in ep.cameras.values())
        started = time.perf_counter()
        ds = DemonstrationDataset(root)
        error = []
        for i, (_, cams) in enumerate(episodes):
            for camera in CAMERAS:
                error.append(np.abs(ds.frames(i, camera).astype(np.int16) - cams[camera]).mean())
        read_s = time.perf_counter() - started
    return {"frames": frames_total, "encode": frames_total / encode_s, "write": frames_total / write_s,
            "read": frames_total / read_s, "bytes/frame": image_bytes / frames_total,
            "raw/frame": raw_bytes / frames_total, "ratio": raw_bytes / image_bytes, "dataset": size,
            "mae": float(np.mean(error))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--size", type=int, default=96)
    args = parser.parse_args()
    episodes = render_episodes(args.episodes, args.size)
    fps = int(get_suite(SUITE).fps)
    print(f"{SUITE}: {args.episodes} episodes, cameras {', '.join(CAMERAS)} at {args.size}×{args.size}, "
          f"{len(os.sched_getaffinity(0))} usable cores, one encoder thread")
    header = f"{'dtype':6} {'frames':>6} {'encode f/s':>10} {'write f/s':>10} {'read f/s':>9} " \
             f"{'B/frame':>8} {'raw B/frame':>11} {'raw/stored':>10} {'dataset B':>10} {'MAE':>5}"
    print(header)
    for dtype in ("video", "image"):
        r = run(episodes, dtype, fps)
        print(f"{dtype:6} {r['frames']:>6} {r['encode']:>10.0f} {r['write']:>10.0f} {r['read']:>9.0f} "
              f"{r['bytes/frame']:>8.0f} {r['raw/frame']:>11.0f} {r['ratio']:>9.1f}× {r['dataset']:>10} "
              f"{r['mae']:>5.2f}")


if __name__ == "__main__":
    main()
