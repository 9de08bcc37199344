"""benchmarks cameras: declared cameras and sizes, rendered frames (shape, orientation, determinism),
pixel suites whose state hides the goal, and state-only episodes that render nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
import pytest

from benchmarks import metaworld as mw
from benchmarks.registry import CameraSpec, SuiteError, catalogue, get_suite
from benchmarks.suite import EpisodeEnv, Suite, TaskSpec

REACH = ("metaworld-mt1-reach", "reach-v3")
REACH_PIXELS = ("metaworld-mt1-reach-pixels", "reach-v3")
SIZES = [(64, 64), (96, 96), (48, 80), (100, 36)]


def frames_after(suite_name: str, task: str, seed: int, actions: list[np.ndarray],
                 cameras: Mapping[str, tuple[int, int]]) -> list[dict[str, np.ndarray]]:
    """The frames after the reset and after each action."""
    with get_suite(suite_name).make_env(task, seed) as env:
        env.reset()
        out = [env.render_images(cameras)]
        for action in actions:
            env.step(action)
            out.append(env.render_images(cameras))
    return out


def red_mask(frame: np.ndarray) -> np.ndarray:
    """Pixels of the Sawyer arm and MetaWorld's red sites/objects."""
    f = frame.astype(np.int16)
    return (f[..., 0] > 90) & (f[..., 1] < 60) & (f[..., 2] < 60)


def red_shift(camera: str, action: list[float], steps: int) -> tuple[float, float]:
    """(rows, columns) the red things move in ``camera``'s picture while the hand repeats ``action``:
    the centre of the pixels that turned red minus the centre of those that stopped being red."""
    before, after = (f[camera] for f in frames_after(*REACH, seed=0, actions=[np.float32(action)] * steps,
                                                     cameras={camera: (96, 96)})[::steps])
    turned, stopped = red_mask(after) & ~red_mask(before), red_mask(before) & ~red_mask(after)
    assert turned.sum() > 20 and stopped.sum() > 20, "the arm or the scene must move in the picture"
    rows, cols = np.indices(turned.shape)
    return rows[turned].mean() - rows[stopped].mean(), cols[turned].mean() - cols[stopped].mean()


# --------------------------------------------------------------------------- declared cameras


def test_suites_declare_cameras_with_default_sizes():
    for name in ("metaworld-mt1-reach", "metaworld-mt10", "metaworld-mt50", "metaworld-mt10-pixels"):
        suite = get_suite(name)
        # a pixel suite adds the top view, so that two views place its hidden goal
        assert suite.camera_names == ["corner", "gripper"] + (["top"] if name.endswith("-pixels") else [])
        assert suite.overview_camera == "corner"
        assert suite.camera("gripper") == mw.CAMERAS[1] and (mw.CAMERAS[1].height, mw.CAMERAS[1].width) == (96, 96)
    pusht = get_suite("pusht")
    assert pusht.camera_names == ["top"] and pusht.overview_camera == "top"
    assert (pusht.camera("top").height, pusht.camera("top").width) == (96, 96)


def test_resolve_cameras_defaults_sizes_and_empty():
    suite = get_suite("metaworld-mt1-reach")
    assert suite.resolve_cameras(["corner", "gripper"]) == {"corner": (96, 96), "gripper": (96, 96)}
    assert suite.resolve_cameras({"gripper": [64, 128]}) == {"gripper": (64, 128)}
    assert suite.resolve_cameras({"corner": (16, 1024)}) == {"corner": (16, 1024)}
    assert suite.resolve_cameras(None) == suite.resolve_cameras({}) == suite.resolve_cameras([]) == {}


@pytest.mark.parametrize("request_, message", [
    (["corner", "wrist"], r"no camera 'wrist'.*its cameras: corner, gripper"),
    ({"top": [96, 96]}, r"no camera 'top'.*its cameras: corner, gripper"),
    ({"corner": [15, 96]}, r"camera 'corner': size 15×96 is outside the limit.*between 16 and 1024"),
    ({"gripper": [96, 1025]}, r"camera 'gripper': size 96×1025 is outside the limit"),
    ({"corner": [96]}, r"camera 'corner': the size must be \[height, width\]"),
    ({"corner": [96.0, 96]}, r"camera 'corner': the size must be \[height, width\]"),
    ({"corner": [True, 96]}, r"camera 'corner': the size must be \[height, width\]"),
    ("corner", r"a list of names or a \{name: \[height, width\]\} mapping, got str"),
    (["corner", "corner"], r"camera names repeat"),
])
def test_resolve_cameras_refuses_bad_requests(request_, message):
    with pytest.raises(SuiteError, match=message):
        get_suite("metaworld-mt1-reach").resolve_cameras(request_)


def test_catalogue_lists_cameras_state_and_action_names():
    entries = {entry["name"]: entry for entry in catalogue()}
    reach = entries["metaworld-mt1-reach"]
    assert reach["cameras"] == [
        {"name": c.name, "height": 96, "width": 96, "description": c.description} for c in mw.CAMERAS]
    assert reach["overview_camera"] == "corner" and all(c["description"] for c in reach["cameras"])
    assert reach["state_names"] == list(mw.STATE_NAMES) and len(reach["state_names"]) == 39
    assert reach["action_names"] == ["hand_dx", "hand_dy", "hand_dz", "gripper_effort"]
    assert entries["pusht"]["cameras"][0]["name"] == "top" and entries["pusht"]["overview_camera"] == "top"
    pixels = entries["metaworld-mt1-reach-pixels"]
    assert pixels["state_dim"] == 36 and pixels["state_names"] == list(mw.STATE_NAMES[:36])
    assert "only the camera images show it" in pixels["description"]
    assert [t["name"] for t in entries["metaworld-mt10-pixels"]["tasks"]] == list(mw.MT10_TASKS)
    assert {f"metaworld-mt1-{t.removesuffix('-v3')}-pixels" for t in mw.ALL_TASKS} <= set(entries)


class _StateOnlyEnv(EpisodeEnv):
    """The least an EpisodeEnv implements: no renderer."""

    def _reset(self, seed):
        return {"state": np.zeros(1, np.float32), "task": self.task}

    def _step(self, action):
        return self._reset(self.seed), 0.0, False, {}

    def close(self):
        pass


def test_a_suite_without_cameras_says_so():
    suite = Suite(name="blind", simulator="none", description="", tasks=(TaskSpec("t", "do it", 5),),
                  state_dim=1, action_dim=1, action_low=(-1.0,), action_high=(1.0,), fps=1.0,
                  env_factory=_StateOnlyEnv)
    with pytest.raises(SuiteError, match=r"suite blind has no camera 'corner'.*its cameras: none"):
        suite.resolve_cameras(["corner"])
    with suite.make_env("t") as env:
        env.reset()
        with pytest.raises(SuiteError, match="suite blind renders no cameras"):
            env.render_images({"corner": (96, 96)})
        assert env.expert_observation()["state"].shape == (1,)
    with pytest.raises(ValueError, match="overview camera 'side' is not one of its cameras"):
        Suite(name="bad", simulator="none", description="", tasks=(TaskSpec("t", "do it", 5),), state_dim=1,
              action_dim=1, action_low=(-1.0,), action_high=(1.0,), fps=1.0, env_factory=_StateOnlyEnv,
              cameras=(CameraSpec("top", 96, 96),), overview_camera="side")


# --------------------------------------------------------------------------- frames


@pytest.mark.parametrize("suite_name,task", [REACH, ("pusht", "push-t")])
def test_frames_are_upright_uint8_hwc_contiguous_at_any_size(suite_name, task):
    suite = get_suite(suite_name)
    with suite.make_env(task, seed=1) as env:
        env.reset()
        for height, width in SIZES:
            frames = env.render_images({name: (height, width) for name in suite.camera_names})
            assert list(frames) == suite.camera_names
            for name, frame in frames.items():
                assert frame.dtype == np.uint8 and frame.shape == (height, width, 3), (name, frame.shape)
                assert frame.flags.c_contiguous, name
                assert frame.std() > 10, f"{name} at {height}×{width}: a picture, not a blank frame"
        with pytest.raises(SuiteError, match=rf"suite {suite_name} has no camera 'side'.*its cameras: "):
            env.render_images({"side": (96, 96)})
        with pytest.raises(SuiteError, match="outside the limit"):
            env.render_images({suite.camera_names[0]: (8, 96)})


def test_metaworld_frames_are_deterministic_and_follow_the_seed():
    cameras = {"corner": (64, 64), "gripper": (48, 80)}
    actions = list(np.random.default_rng(3).uniform(-1, 1, size=(6, 4)).astype(np.float32))
    first = frames_after(*REACH, seed=2, actions=actions, cameras=cameras)
    second = frames_after(*REACH, seed=2, actions=actions, cameras=cameras)
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        for name in cameras:
            assert a[name].tobytes() == b[name].tobytes(), f"{name} differs at step {step}"
    assert any(not np.array_equal(first[0]["corner"], f["corner"]) for f in first[1:]), "the arm moves"
    other_seed = frames_after(*REACH, seed=3, actions=[], cameras=cameras)[0]
    assert other_seed["corner"].tobytes() != first[0]["corner"].tobytes(), "another seed, another goal"


def test_pusht_top_frames_are_deterministic_and_are_gym_pushts_pixel_observation():
    from gym_pusht.envs.pusht import PushTEnv as GymPushT

    actions = [np.float32([250.0 + 20 * i, 300.0 - 10 * i]) for i in range(5)]
    first = frames_after("pusht", "push-t", 4, actions, {"top": (96, 96)})
    second = frames_after("pusht", "push-t", 4, actions, {"top": (96, 96)})
    assert [f["top"].tobytes() for f in first] == [f["top"].tobytes() for f in second]
    theirs = GymPushT(obs_type="pixels", render_mode="rgb_array")
    try:
        pixels, _ = theirs.reset(seed=4)
        expected = [pixels] + [theirs.step(a.astype(np.float64))[0] for a in actions]
    finally:
        theirs.close()
    for step, (ours, gyms) in enumerate(zip(first, expected, strict=True)):
        np.testing.assert_array_equal(ours["top"], gyms, err_msg=f"step {step}")
    assert not np.array_equal(first[0]["top"], first[-1]["top"]), "the agent moves"


def test_corner_camera_is_upright_and_not_mirrored():
    # Raising the hand moves the arm up the picture; +x (to the robot's right, seen from the
    # front-left corner) moves it right. MuJoCo's raw "corner" view gets both backwards.
    rows, _ = red_shift("corner", [0, 0, 1, 0], steps=12)
    assert rows < -3, rows
    _, cols = red_shift("corner", [1, 0, 0, 0], steps=25)
    assert cols > 3, cols


def test_gripper_camera_has_forward_up_and_x_to_the_right():
    # The camera rides on the hand looking down: moving forward (+y) slides the table down the
    # picture, moving +x slides it left.
    rows, _ = red_shift("gripper", [0, 1, 0, 0], steps=12)
    assert rows > 3, rows
    _, cols = red_shift("gripper", [1, 0, 0, 0], steps=12)
    assert cols < -3, cols


def test_a_state_only_episode_renders_nothing_and_renderers_are_reused():
    suite = get_suite(REACH[0])
    with suite.make_env(REACH[1], seed=0) as env:
        obs = env.reset()
        expert = suite.expert(REACH[1])
        for _ in range(5):
            obs = env.step(expert(obs)).obs
        assert "images" not in obs and env._renderers == {}, "reset and step never render"
        env.render_images({"corner": (64, 64), "gripper": (64, 64)})
        renderer = env._renderers[(64, 64)]
        env.render_images({"gripper": (64, 64)})
        assert env._renderers == {(64, 64): renderer}, "one renderer per size, kept"
        replay = env.render_frame(160, 120)
        assert replay.shape == (120, 160, 3)
        np.testing.assert_array_equal(replay, env.render_images({"corner": (120, 160)})["corner"])
        assert set(env._renderers) == {(64, 64), (120, 160)}
    assert env._renderers == {}, "close() frees the renderers"


# --------------------------------------------------------------------------- pixel suites


def test_pixel_suite_state_hides_the_goal_from_the_policy_not_the_expert():
    suite = get_suite(REACH_PIXELS[0])
    assert suite.state_dim == 36 and suite.state_names == mw.STATE_NAMES[:36]
    assert not any(name.startswith("goal") for name in suite.state_names)
    states, goals = [], []
    with suite.make_env(REACH_PIXELS[1], seed=0) as env:
        for seed in range(5):
            obs = env.reset(seed)
            full = env.expert_observation()["state"]
            assert obs["state"].shape == (36,) and full.shape == (39,)
            np.testing.assert_array_equal(obs["state"], full[:36])
            states.append(obs["state"])
            goals.append(full[36:])
    states, goals = np.array(states), np.array(goals)
    assert (goals.std(axis=0) > 1e-3).all(), "the goal changes with the seed"
    for axis, goal in zip("xyz", goals.T, strict=True):
        matching = [suite.state_names[i] for i in range(36) if np.allclose(states[:, i], goal, atol=1e-4)]
        assert not matching, f"goal_{axis} is still in the pixel state as {matching}"
    with get_suite(REACH[0]).make_env(REACH[1], seed=3) as full_env:
        np.testing.assert_array_equal(full_env.reset()["state"][36:], goals[3])


def test_pixel_suite_expert_succeeds_through_expert_observation():
    suite = get_suite(REACH_PIXELS[0])
    expert = suite.expert(REACH_PIXELS[1])
    with suite.make_env(REACH_PIXELS[1], seed=1) as env:
        obs = env.reset()
        with pytest.raises(SuiteError, match=r"full 39-value state, got 36 values; pass it env.expert_observation"):
            expert(obs)
        while True:
            result = env.step(expert(env.expert_observation()))
            if result.done:
                break
        assert result.success and env.steps < 500 and result.obs["state"].shape == (36,)


def test_every_metaworld_task_has_the_mujoco_cameras_we_render():
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    wanted = {mujoco_name for mujoco_name, _ in mw._MUJOCO_CAMERAS.values()}
    assert set(mw._MUJOCO_CAMERAS) == {c.name for c in mw.PIXEL_CAMERAS}
    for task, env_class in ALL_V3_ENVIRONMENTS.items():
        env = env_class()
        try:
            model = env.model
            assert wanted <= {model.camera(i).name for i in range(model.ncam)}, task
        finally:
            env.close()


def test_rendering_without_a_context_names_the_backend_and_the_fix():
    # MuJoCo imported before benchmarks.metaworld could choose a headless backend: it binds GLFW,
    # which needs a display this process does not have.
    code = (
        "import mujoco\n"
        "from benchmarks.registry import get_suite\n"
        "env = get_suite('metaworld-mt1-reach').make_env('reach-v3'); env.reset()\n"
        "try:\n"
        "    env.render_images({'corner': (32, 32)})\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "DISPLAY", "PYOPENGL_PLATFORM")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=environment,
                         timeout=120).stdout
    assert out.startswith("RenderingUnavailable metaworld-mt1-reach/reach-v3: MuJoCo cannot make an offscreen "
                          "OpenGL context with its glfw backend"), out
    assert "imported before MUJOCO_GL=" in out and "MUJOCO_GL=osmesa" in out, out


def test_a_process_that_rendered_can_still_import_triton():
    # Mesa's llvmpipe loads its LLVM globally; a triton imported after it crashed the process.
    pytest.importorskip("triton")
    code = (
        "from benchmarks.registry import get_suite\n"
        "with get_suite('metaworld-mt1-reach').make_env('reach-v3') as env:\n"
        "    env.reset(); env.render_images({'corner': (32, 32)})\n"
        "import triton\n"
        "print('imported')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "imported", (result.returncode, result.stderr[-2000:])


def test_a_pixel_suite_draws_its_goal_big_and_green_and_plays_as_the_stock_one():
    """The state of a pixel suite lacks the goal, so its frames show it as a 4 cm green sphere instead of
    MetaWorld's 2 cm red site beside the red arm; a site has no physics, so the episode is the same."""
    stock, pixels = get_suite("metaworld-mt1-reach"), get_suite("metaworld-mt1-reach-pixels")
    assert pixels.rendering and not stock.rendering and "rendering" not in stock._definition()
    assert pixels._definition()["rendering"] == mw.PIXEL_RENDERING

    def green(frame: np.ndarray) -> int:
        r, g, b = (frame[..., i].astype(int) for i in range(3))
        return int(((g > 180) & (r < 90) & (b < 90)).sum())

    seen = {}
    for suite in (stock, pixels):
        env = suite.make_env("reach-v3", 3)
        try:
            env.reset(3)
            frames = env.render_images({"corner": (64, 64), "top": (64, 64)} if suite is pixels
                                       else {"corner": (64, 64)})
            action = np.array([0.5, -0.3, 0.2, 0.0], np.float32)
            steps = [env.step(action) for _ in range(5)]
            seen[suite.name] = (frames, [s.obs["state"][:36].tolist() for s in steps])
        finally:
            env.close()
    stock_frames, stock_states = seen[stock.name]
    pixel_frames, pixel_states = seen[pixels.name]
    assert green(stock_frames["corner"]) == 0
    assert green(pixel_frames["corner"]) >= 4 and green(pixel_frames["top"]) >= 4  # a few pixels at 64 px
    assert pixel_states == stock_states  # the marker changes the picture, not the physics


def test_the_first_frame_of_an_episode_shows_its_own_goal():
    """MetaWorld places the goal site after its last kinematics pass of a reset; without bringing the scene
    up to date the first frame of every episode showed the previous episode's goal."""
    import mujoco

    env = get_suite("metaworld-mt1-reach-pixels").make_env("reach-v3", 0)
    try:
        for seed in (0, 1, 2):
            env.reset(seed)
            first = env.render_images({"corner": (64, 64)})["corner"]
            model, data = env._env.model, env._env.data
            goal_site = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, "goal")
            np.testing.assert_allclose(data.site_xpos[goal_site], env.hidden_state()[1], atol=1e-6)
            mujoco.mj_kinematics(model, data)
            np.testing.assert_array_equal(first, env.render_images({"corner": (64, 64)})["corner"])
    finally:
        env.close()
