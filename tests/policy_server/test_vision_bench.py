"""``bench/vision_episodes.py`` runs end to end at a tiny size: two real hf policy servers (the vision
policy shaped like configs/vla-reach-pixels.yaml and a state-only one), MetaWorld reach episodes
played by the worker runner on a scratch PostgreSQL database, and its two tables printed with the
vision policy's frames rendered, encoded and timed. No timing is asserted; only that every figure
the tables need was measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _rows(output: str, header_start: str) -> dict[str, list[str]]:
    """The markdown table whose header begins with ``header_start``: first cell → the other cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_vision_episodes_bench_runs_and_measures_every_part(tmp_path, postgres_url):
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
           "BENCH_DATABASE_URL": postgres_url.rsplit("/", 1)[0] + "/postgres"}
    result = subprocess.run(
        [sys.executable, "bench/vision_episodes.py", "--engine", "hf", "--episodes", "2", "--rounds", "1",
         "--max-steps", "8", "--workdir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    episodes = _rows(result.stdout, "| policy | episodes |")
    assert set(episodes) == {"vision (corner 64×64)", "state only"}
    for cells in episodes.values():
        assert cells[0] == "2" and float(cells[1]) > 0  # both episodes played, a rate computed
        assert cells[6] == "2"  # 8 steps, chunk 4: two inferences per episode
    assert episodes["state only"][3] == "1.00×"
    parts = _rows(result.stdout, "| policy | step (loop) ×4 |")
    vision, state = parts["vision (corner 64×64)"], parts["state only"]
    assert float(vision[1]) > 0 and float(state[1]) == 0  # only the vision policy's episodes render
    assert float(vision[2].split()[0]) > 0 and state[2] == "—"  # the frame's codec, measured
    assert float(vision[3]) > 0 and float(state[3]) == 0  # the server's encoder wait
    assert float(vision[4]) > 0 and float(state[4]) > 0  # the engine
