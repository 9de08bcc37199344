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


def _table(output: str, header_start: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header begins with ``header_start``."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _rows(output: str, header_start: str) -> dict[str, list[str]]:
    """The same table keyed by its rows' first cell: first cell → the other cells."""
    return {cells[0]: cells[1:] for cells in _table(output, header_start)}


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


@pytest.mark.vllm
def test_policy_server_bench_measures_the_vision_server_against_raw_and_raw_plus_encoder(tmp_path):
    """``bench/policy_server.py --sizes vision`` at one short window: the server, both raw placements and
    raw + encoder (the raw engine with the policy's encoder in the benchmark process) each finish
    requests, and raw + encoder's CPU row carries its encoder's share. No timing is asserted."""
    result = subprocess.run(
        [sys.executable, "bench/policy_server.py", "--sizes", "vision", "--clients", "2", "--seconds", "1",
         "--rounds", "1", "--no-one-at-a-time", "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    by_side = {row[1]: float(row[2]) for row in _table(result.stdout, "| policy | raw engine |")}
    assert set(by_side) == {"raw, engine core anywhere", "raw, engine core on compute cores",
                            "raw + encoder, engine core anywhere"}
    assert all(rate > 0 for rate in by_side.values())
    encoder_share = {row[2]: row[5] for row in _table(result.stdout, "| policy | clients | side |")}
    assert float(encoder_share["raw + encoder, engine core anywhere"]) > 0
    assert float(encoder_share["server"]) > 0 and encoder_share["raw, engine core anywhere"] == "—"
    assert "server / raw + encoder" in result.stdout


def test_vision_encoder_bench_times_a_window_beside_other_work():
    """``bench/vision_encoder.py`` at its smallest: its third table times a forward alone and beside each
    neighbour, every figure measured."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the neighbours table needs two cores")
    result = subprocess.run(
        [sys.executable, "bench/vision_encoder.py", "--counts", "1", "--repeats", "1", "--window", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("one forward of 2 images"))
    rows = lines[start + 2:start + 6]
    assert [row.split("  ")[0] for row in rows] == [
        "alone", "a busy loop on another core", "a torch matmul loop on another core (vLLM's worker)",
        "a sched_yield() spinner on the same core (vLLM's engine core)"]
    for row in rows:
        wall, cpu, ratio = row.split()[-3:]
        assert float(wall) > 0 and float(cpu) > 0 and ratio.endswith("x")
    assert rows[0].split()[-1] == "1.00x"
