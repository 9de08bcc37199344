"""OGBench suites: catalogue facts, random and oracle-expert episodes, seed determinism of states and
frames, upright frames, and the Lights Out solver the puzzle expert plans with."""

from __future__ import annotations

import numpy as np
import pytest

# benchmarks.ogbench (via benchmarks.metaworld) picks MuJoCo's headless backend, so it comes first.
from benchmarks import ogbench as og
from benchmarks.registry import SuiteError, catalogue, get_suite

pytest.importorskip("ogbench")

SUITES = ("ogbench-cube-single", "ogbench-scene", "ogbench-puzzle-3x3")


@pytest.fixture(scope="module")
def envs():
    """One environment per suite (task1), built once: building is the slow part."""
    made = {name: get_suite(name).make_env("task1", seed=0) for name in SUITES}
    yield made
    for env in made.values():
        env.close()


def test_catalogue_facts():
    entries = {e["name"]: e for e in catalogue()}
    expected = {"ogbench-cube-single": (28, 200), "ogbench-scene": (40, 750), "ogbench-puzzle-3x3": (55, 500)}
    for name, (state_dim, max_steps) in expected.items():
        entry = entries[name]
        assert entry["simulator"] == "ogbench" and entry["has_expert"]
        assert entry["state_dim"] == state_dim == len(entry["state_names"])
        assert [t["name"] for t in entry["tasks"]] == [f"task{i}" for i in range(1, 6)]
        assert {t["max_steps"] for t in entry["tasks"]} == {max_steps}
        assert entry["action_dim"] == 5 and entry["action_low"] == [-1.0] * 5 and entry["action_high"] == [1.0] * 5
        assert entry["action_names"] == list(og.ACTION_NAMES) and entry["fps"] == 20.0
        assert entry["cameras"][0] | {"description": ""} == {"name": "front", "height": 64, "width": 64,
                                                              "description": ""}
        assert entry["overview_camera"] == "front"
    tasks = entries["ogbench-cube-single"]["tasks"]
    assert "(OGBench task1_horizontal)" in tasks[0]["instruction"]
    assert "(OGBench task4_put_in_drawer)" in entries["ogbench-scene"]["tasks"][3]["instruction"]
    assert entries["ogbench-scene"]["state_names"][-4:] == ["drawer_pos", "drawer_vel", "window_pos", "window_vel"]


@pytest.mark.parametrize("name", SUITES)
def test_random_policy_episode(envs, name):
    env, suite = envs[name], get_suite(name)
    rng = np.random.default_rng(0)
    obs = env.reset(3)
    assert obs["state"].shape == (suite.state_dim,) and obs["state"].dtype == np.float32 and obs["task"] == "task1"
    steps = suite.max_steps("task1") if name == "ogbench-cube-single" else 60
    for _ in range(steps):
        result = env.step(rng.uniform(-1.5, 1.5, size=5))  # out of bounds: the wrapper clips
        assert np.isfinite(result.obs["state"]).all()
        assert np.abs(result.info["action"]).max() <= 1.0
        if result.done:
            break
    if name == "ogbench-cube-single":
        assert result.done and env.steps == 200 and not result.success and result.info["truncated"]


@pytest.mark.parametrize("name", SUITES)
def test_oracle_expert_solves_task1(envs, name):
    env, expert = envs[name], get_suite(name).expert("task1")
    env.reset(0)
    with pytest.raises(SuiteError, match="pass it env.expert_observation"):
        expert({"state": env.expert_observation()["state"], "task": "task1"})
    while True:
        result = env.step(expert(env.expert_observation()))
        if result.done:
            break
    assert result.success, f"{name}/task1: the oracle expert failed after {env.steps} steps"
    assert env.steps < get_suite(name).max_steps("task1")


def _rollout(env, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """States and the final frame after a fixed action sequence from ``seed``."""
    states = [env.reset(seed)["state"]]
    rng = np.random.default_rng(42)
    for _ in range(8):
        states.append(env.step(rng.uniform(-1, 1, size=5)).obs["state"])
    return np.stack(states), env.render_images({"front": (64, 64)})["front"]


@pytest.mark.parametrize("name", SUITES)
def test_same_seed_same_states_and_frames(envs, name):
    env = envs[name]
    states, frame = _rollout(env, 11)
    _rollout(env, 12)  # another episode in between: reset must not carry anything over
    again_states, again_frame = _rollout(env, 11)
    other_states, _ = _rollout(env, 12)
    assert np.array_equal(states, again_states) and np.array_equal(frame, again_frame)
    assert not np.array_equal(states[0], other_states[0]), "different seeds must give different starts"


@pytest.mark.parametrize("name", SUITES)
def test_frames_upright_uint8_contiguous(envs, name):
    env = envs[name]
    env.reset(0)
    for height, width in ((64, 64), (96, 128)):
        frame = env.render_images({"front": (height, width)})["front"]
        assert frame.dtype == np.uint8 and frame.shape == (height, width, 3) and frame.flags.c_contiguous
        f = frame.astype(np.int16)
        # The camera looks down at the table from in front of it, so the red cube (cube-single) and
        # the puzzle's red caps lie below the middle of an upright picture. All three suites render
        # with the same code; the scene's cube starts on its goal in task1, drawn light red.
        red = (f[..., 0] > 150) & (f[..., 1] < 100) & (f[..., 2] < 130)
        if name == "ogbench-cube-single":
            assert red[height // 2:].sum() > 3 and red[:height // 2].sum() == 0, "the cube must be in the lower half"
        if name == "ogbench-puzzle-3x3":
            assert np.indices(red.shape)[0][red].mean() > height / 2, "the buttons must be below the middle"
    with pytest.raises(SuiteError, match="has no camera 'corner'"):
        env.render_images({"corner": (64, 64)})


def _press(states: np.ndarray, buttons: list[int]) -> np.ndarray:
    out = np.array(states)
    for b in buttons:
        r, c = divmod(b, 3)
        for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
            if 0 <= r + dr < 3 and 0 <= c + dc < 3:
                out[(r + dr) * 3 + c + dc] ^= 1
    return out


def test_lights_out_presses_solve_every_puzzle_goal():
    from ogbench.manipspace.envs.puzzle_env import PuzzleEnv

    # The task definitions only (no simulator compiled: the model is built on the first reset).
    tasks = PuzzleEnv(env_type="3x3").task_infos
    for task in tasks:
        start, goal = task["init_button_states"], task["goal_button_states"]
        presses = og.lights_out_presses(start, goal, 3, 3)
        assert np.array_equal(_press(start, presses), goal), task["task_name"]
    assert og.lights_out_presses(np.zeros(9, int), np.zeros(9, int), 3, 3) == []
    assert og.lights_out_presses(np.zeros(9, int), _press(np.zeros(9, int), [4]), 3, 3) == [4]


def test_collect_demos_records_the_oracles_episodes(tmp_path):
    """`trainer collect-demos` on an OGBench suite: the chained oracles' successful episodes become a dataset."""
    from trainer.collect_demos import collect_demos
    from trainer.data.lerobot import DemonstrationDataset

    report = collect_demos("ogbench-cube-single", tmp_path / "demos", 1, workers=1, show_progress=False)
    assert report.episodes == 5 and all(t.successes >= 1 for t in report.tasks)
    dataset = DemonstrationDataset(tmp_path / "demos")
    assert len(dataset) == 5 and {episode.task for episode in dataset} == {f"task{i}" for i in range(1, 6)}
