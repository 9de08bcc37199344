"""ALOHA suites: the catalogue (no simulator), the action bounds against gym-aloha's MJCF, and one
reused environment per task: a random-policy episode that renders nothing, ACT's scripted expert
succeeding (and in ``collect-demos``), seed determinism of state and frames, physics and frames
equal to gym-aloha's own environment, and upright frames."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from benchmarks import aloha as al
from benchmarks.registry import SuiteError, catalogue, get_suite

SUITES = {"aloha-transfer-cube": al.TRANSFER_CUBE, "aloha-insertion": al.INSERTION}
TOP = {"top": (al.CAMERAS[0].height, al.CAMERAS[0].width)}


# --------------------------------------------------------------------------- catalogue (no simulator)


def test_catalogue_lists_both_suites_with_their_facts():
    entries = {entry["name"]: entry for entry in catalogue()}
    for name, task in SUITES.items():
        entry = entries[name]
        assert entry["simulator"] == "aloha" and entry["has_expert"] is True and entry["fps"] == 50.0
        assert entry["tasks"] == [{"name": task, "instruction": al.INSTRUCTIONS[task], "max_steps": 400}]
        assert entry["state_dim"] == entry["action_dim"] == 14
        assert entry["state_names"] == entry["action_names"] == list(al.STATE_NAMES)
        assert entry["state_names"][:7] == ["left_arm_waist", "left_arm_shoulder", "left_arm_elbow",
                                            "left_arm_forearm_roll", "left_arm_wrist_angle",
                                            "left_arm_wrist_rotate", "left_arm_gripper"]
        assert entry["state_names"][13] == "right_arm_gripper"
        assert entry["action_low"][6] == entry["action_low"][13] == 0.0
        assert entry["action_high"][6] == entry["action_high"][13] == 1.0
        assert entry["cameras"] == [{"name": "top", "height": 240, "width": 320,
                                     "description": al.CAMERAS[0].description}]
        assert entry["overview_camera"] == "top"
    assert entries["aloha-transfer-cube"]["tasks"][0]["instruction"] == (
        "Pick up the cube with the right arm and transfer it to the left arm.")


def test_reading_the_catalogue_imports_no_simulator():
    code = ("import sys, benchmarks.registry as r; r.catalogue(); r.get_suite('aloha-insertion').expert; "
            "print(sorted(m for m in ('gym_aloha', 'dm_control', 'mujoco') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_action_bounds_are_the_arms_actuator_ranges_in_gym_alohas_models():
    import mujoco
    from gym_aloha.constants import ASSETS_DIR, JOINTS

    assert al.STATE_NAMES == tuple(JOINTS)
    for task, (xml, _) in al._MODELS.items():
        model = mujoco.MjModel.from_xml_path(str(ASSETS_DIR / xml))
        arms = model.actuator_ctrlrange[[*range(6), *range(8, 14)]]  # each arm: 6 joints, then 2 fingers
        expected = np.delete(np.asarray([al.ACTION_LOW, al.ACTION_HIGH]).T, [6, 13], axis=0)
        np.testing.assert_array_equal(arms, expected, err_msg=task)


# --------------------------------------------------------------------------- one environment per task


@pytest.fixture(scope="module")
def envs():
    made = {name: get_suite(name).make_env(task, seed=0) for name, task in SUITES.items()}
    yield made
    for env in made.values():
        env.close()


def test_random_policy_episode_ends_at_the_step_limit_and_renders_nothing(envs):
    env = envs["aloha-insertion"]
    suite = env.suite
    env.max_steps = 20
    try:
        obs = env.reset(4)
        assert obs["state"].dtype == np.float32 and obs["state"].shape == (14,) and obs["task"] == al.INSERTION
        rng = np.random.default_rng(0)
        results = [env.step(rng.uniform(suite.action_low_array, suite.action_high_array)) for _ in range(20)]
    finally:
        env.max_steps = al.MAX_STEPS
    assert [r.done for r in results] == [False] * 19 + [True]
    assert not results[-1].success and results[-1].info["truncated"]
    assert {r.reward for r in results} <= {0.0, 1.0, 2.0, 3.0}
    states = np.stack([r.obs["state"] for r in results])
    assert np.isfinite(states).all() and np.ptp(states[:, :6], axis=0).max() > 0.05, "the arms must move"
    assert all("images" not in r.obs for r in results)
    # dm_control makes its OpenGL contexts on the first render of a Physics: none means nothing rendered.
    assert env._physics._contexts is None, "reset and step never render"


@pytest.mark.parametrize("name", SUITES)
def test_scripted_expert_succeeds(envs, name):
    env = envs[name]
    expert = env.suite.expert(env.task)
    env.reset(11)
    with pytest.raises(SuiteError, match="pass it env.expert_observation"):
        expert({"state": env.expert_observation()["state"], "task": env.task})
    while True:
        result = env.step(expert(env.expert_observation()))
        if result.done:
            break
    assert result.success and result.reward == al.SUCCESS_REWARD and env.steps < al.MAX_STEPS


def test_collect_demos_records_the_experts_episodes(tmp_path):
    from trainer.collect_demos import collect_demos

    report = collect_demos("aloha-transfer-cube", tmp_path / "demos", 1, workers=1, show_progress=False)
    assert report.episodes == 1 and report.tasks[0].successes == report.tasks[0].attempts == 1


def test_same_seed_same_state_and_frames_whatever_ran_before(envs):
    env = envs["aloha-transfer-cube"]

    def episode(seed: int) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
        first = env.reset(seed)
        frames = env.render_images(TOP)
        pose = env.expert_observation()["initial_object_pose"]
        rng = np.random.default_rng(seed)
        for _ in range(10):
            result = env.step(np.clip(first["state"] + rng.normal(0, 0.2, 14), env.suite.action_low_array,
                                      env.suite.action_high_array))
        return frames, pose, first["state"], result.obs["state"]

    first = episode(5)
    episode(6)  # another initial state and other actions in between
    again = episode(5)
    assert first[0]["top"].tobytes() == again[0]["top"].tobytes()
    for a, b in zip(first[1:], again[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    env.reset(6)
    assert not np.array_equal(env.expert_observation()["initial_object_pose"], first[1])
    assert env.render_images(TOP)["top"].tobytes() != first[0]["top"].tobytes(), "another seed, another cube pose"
    with pytest.raises(ValueError, match="below 2\\*\\*32"):
        env.reset(2**32)


@pytest.mark.parametrize("name", SUITES)
def test_physics_and_frames_are_gym_alohas_own(envs, name):
    """A seed starts where gym-aloha's reset(seed=seed) does, steps as it does, and a 480 × 640 top
    frame is byte for byte gym-aloha's observation (so policies trained on its images see the same)."""
    from gym_aloha.env import AlohaEnv as GymAlohaEnv

    env = envs[name]
    theirs = GymAlohaEnv(env.task.replace("-", "_"), obs_type="pixels_agent_pos")
    obs = env.reset(3)
    their_obs, _ = theirs.reset(seed=3)
    rng = np.random.default_rng(3)
    for step in range(4):
        np.testing.assert_array_equal(obs["state"], their_obs["agent_pos"].astype(np.float32), err_msg=str(step))
        np.testing.assert_array_equal(env._physics.data.qpos, theirs._env.physics.data.qpos, err_msg=str(step))
        assert env.render_images({"top": (480, 640)})["top"].tobytes() == their_obs["pixels"]["top"].tobytes()
        action = np.clip(obs["state"] + rng.normal(0, 0.2, 14), env.suite.action_low_array,
                         env.suite.action_high_array).astype(np.float32)
        result = env.step(action)
        their_obs, their_reward, *_ = theirs.step(action.astype(np.float64))
        obs = result.obs
        assert result.reward == their_reward


def test_frames_are_upright_uint8_hwc_contiguous(envs):
    env = envs["aloha-transfer-cube"]
    for height, width in [(240, 320), (224, 224), (96, 128)]:
        env.reset(1)
        frame = env.render_images({"top": (height, width)})["top"]
        assert frame.dtype == np.uint8 and frame.shape == (height, width, 3) and frame.flags.c_contiguous
        assert frame.std() > 10
    # The red cube's place in the picture follows its place on the table: +x (the right arm's side)
    # to the right, +y (the far side, away from the front) up. A flip or a turn breaks one of them.
    places = []
    for seed in range(4):
        env.reset(seed)
        frame = env.render_images(TOP)["top"].astype(np.int16)
        red = (frame[..., 0] > 150) & (frame[..., 1] < 60) & (frame[..., 2] < 60)
        rows, cols = np.nonzero(red)
        assert red.sum() > 20, seed
        x, y = env.expert_observation()["initial_object_pose"][:2]
        places.append((x, y, cols.mean(), rows.mean()))
    x, y, col, row = np.asarray(places).T
    assert np.corrcoef(x, col)[0, 1] > 0.95 and np.corrcoef(y, row)[0, 1] < -0.95, places
    # Both arms reach in from the picture's sides (their light grey links).
    light = env.render_images(TOP)["top"].min(axis=-1) > 150
    assert light[:, :16].mean() > 0.02 and light[:, -16:].mean() > 0.02
