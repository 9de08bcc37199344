"""MetaWorld (v3 tasks, MuJoCo) as EvalForge suites, with MetaWorld's own scripted experts.

Suites:

- ``metaworld-mt1-<task>`` for each of the 50 tasks (the suite name drops the
  ``-v3`` suffix; the task keeps MetaWorld's name: ``metaworld-mt1-reach`` has the
  task ``reach-v3``);
- ``metaworld-mt10`` and ``metaworld-mt50``: MetaWorld's MT10 and MT50 task sets,
  in MetaWorld's order;
- pixel variants ``metaworld-mt1-<task>-pixels`` (all 50) and ``metaworld-mt10-pixels``:
  the same tasks, seeds and experts, but the state has the goal removed (36 values),
  so a policy must find the goal in the images. MetaWorld draws a task's goal as a small
  red site (2 cm, beside a red arm: a pixel or two at 64 px) or it is the place the task's
  own objects imply; a pixel suite draws that site as a 4 cm green sphere
  (``PIXEL_RENDERING``, part of its definition hash; a site has no physics) and adds a
  ``top`` camera, so that two views place the goal in 3-D.

Observation: MetaWorld's 39-dim state with the goal visible (the multi-task
setting: hand xyz, gripper opening, two objects' xyz + quaternion, the same 18
values from the previous step, goal xyz; ``STATE_NAMES``). The task is the
observation's ``task`` field, never a one-hot in the state. Action: 4 values in
[-1, 1] (hand dx, dy, dz and gripper effort). 500 steps per episode, MetaWorld's
``max_path_length``; success is MetaWorld's ``info["success"]`` and ends the
episode. ``fps`` is the control rate, 1 / (MuJoCo timestep 0.0025 s × frame skip 5) = 80.
A pixel suite's expert reads the full 39 values from ``env.expert_observation()``.

Seed → initial state: MetaWorld draws each episode's object and goal positions
(its "rand_vec") from the environment's ``np_random``. We give that generator a
fresh ``numpy.random.default_rng([crc32(task), seed])`` before every reset and
never use NumPy's global RNG, so a (task, seed) pair always gives the same initial
state, independently of what ran before, and different tasks with the same seed
do not share their random draws. PCG64 streams are identical on every platform;
the physics that settles the arm after the draw is deterministic for a given
MuJoCo build and CPU architecture.

Cameras (``CAMERAS``, default 96 × 96, the size of common visuomotor policies'
inputs, e.g. Diffusion Policy's PushT):

- ``corner`` (the overview camera, what replays show): MuJoCo camera ``corner``, the
  table, arm and goal from the front left corner. MetaWorld mounts its corner
  cameras upside down, so the picture is turned 180 degrees;
- ``gripper``: MuJoCo camera ``gripperPOV``, on the hand, looking down at the table
  with the forward direction (away from the robot) at the top of the picture; it is
  upright as MuJoCo renders it;
- ``top`` (pixel suites only): MuJoCo camera ``topview``, the table from above with the
  robot at the bottom, upright as MuJoCo renders it.

Rendering happens only in ``render_images`` (and ``render_frame``), offscreen with
MuJoCo's own ``mujoco.Renderer``: one per image size, made on first use and kept
until ``close()``; a state-only episode never makes one. Shadows and reflections
are switched off: in software they cost ~90% of a frame. Physics is untouched,
so a rendered episode plays exactly like an unrendered one, and the same seed and
actions give byte-identical frames (one renderer, one build).

Headless OpenGL (``MUJOCO_GL``), triton before Mesa, and what to do when no context
can be made (``RenderingUnavailable``) are ``benchmarks/rendering.py``'s, shared with
the other MuJoCo simulators.

Nothing here imports ``metaworld`` until an environment or expert is made, so the
suite catalogue stays cheap to read.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np

from benchmarks.rendering import offscreen_renderer
from benchmarks.suite import (
    CameraSpec,
    EpisodeEnv,
    ExpertPolicy,
    SimObservation,
    Suite,
    SuiteError,
    TaskSpec,
    canonical_observation,
)

MAX_STEPS = 500
FPS = 80.0
SEED_RULE = ("seed -> numpy.random.default_rng([zlib.crc32(task), seed]) as the env's np_random before every "
             "reset, which draws the object and goal positions (rand_vec); NumPy's global RNG is never used")
"""Seed → initial state, as ``Suite.seed_rule`` says it (part of every MetaWorld suite's definition hash)."""



CAMERAS: tuple[CameraSpec, ...] = (
    CameraSpec("corner", 96, 96, "the table, the arm and the goal from the front left corner"),
    CameraSpec("gripper", 96, 96, "from the hand, looking down at the table; away from the robot is up"),
)
PIXEL_CAMERAS: tuple[CameraSpec, ...] = CAMERAS + (
    CameraSpec("top", 96, 96, "the table from above, the robot at the bottom; away from the robot is up"),
)
"""A pixel suite's cameras: ``top`` as well, so that two views place the goal in 3-D (one view
leaves it anywhere along a ray)."""
OVERVIEW_CAMERA = "corner"
"""The replay camera: the table, the arm and the goal from the front corner."""

# Our camera name -> (MuJoCo camera in MetaWorld's XML, whether it is mounted upside down).
_MUJOCO_CAMERAS: dict[str, tuple[str, bool]] = {"corner": ("corner", True), "gripper": ("gripperPOV", False),
                                                "top": ("topview", False)}

GOAL_MARKER_RADIUS = 0.04
GOAL_MARKER_RGBA = (0.1, 1.0, 0.1, 1.0)
PIXEL_RENDERING = (f"the goal site, where the task draws it, as a sphere of radius {GOAL_MARKER_RADIUS} m in rgba "
                   f"{list(GOAL_MARKER_RGBA)} (MetaWorld's own: 0.02 m, red like the arm: one or two pixels at 64 px); "
                   "the first frame shows the episode's own goal")
"""How a pixel suite draws its goal: the state no longer holds it, so the images must show it. A
site has no physics, so episodes play exactly as with the stock marker."""

# MetaWorld ships no language; these follow the task descriptions of the MetaWorld
# paper (Yu et al., 2019, appendix), in the order of metaworld.env_dict.ALL_V3_ENVIRONMENTS.
INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "pick up the nut and place it onto the peg",
    "basketball-v3": "dunk the basketball into the basket",
    "bin-picking-v3": "grasp the puck from one bin and place it into the other bin",
    "box-close-v3": "grasp the cover and close the box with it",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "bypass the wall and press the button from the top",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "bypass the wall and press the button",
    "coffee-button-v3": "push the button on the coffee machine",
    "coffee-pull-v3": "pull the mug out from under the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "rotate the dial 180 degrees",
    "disassemble-v3": "pick the nut out of the peg",
    "door-close-v3": "close the door with a revolving joint",
    "door-lock-v3": "lock the door by rotating the lock clockwise",
    "door-open-v3": "open the door with a revolving joint",
    "door-unlock-v3": "unlock the door by rotating the lock counter-clockwise",
    "hand-insert-v3": "insert the gripper into the hole",
    "drawer-close-v3": "push the drawer closed",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "rotate the faucet counter-clockwise",
    "faucet-close-v3": "rotate the faucet clockwise",
    "hammer-v3": "hammer the screw into the wall",
    "handle-press-side-v3": "press the handle down sideways",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up sideways",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever down 90 degrees",
    "pick-place-wall-v3": "pick up the puck, bypass the wall and place the puck at the goal",
    "pick-out-of-hole-v3": "pick the puck up out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the cabinet",
    "plate-slide-side-v3": "slide the plate into the cabinet sideways",
    "plate-slide-back-v3": "slide the plate out of the cabinet",
    "plate-slide-back-side-v3": "slide the plate out of the cabinet sideways",
    "peg-insert-side-v3": "insert the peg into the hole sideways",
    "peg-unplug-side-v3": "unplug the peg sideways",
    "soccer-v3": "kick the soccer ball into the goal",
    "stick-push-v3": "grasp the stick and push the box with it",
    "stick-pull-v3": "grasp the stick and pull the box with it",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "bypass the wall and push the puck to the goal",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the goal position",
    "reach-wall-v3": "bypass the wall and reach the goal position",
    "shelf-place-v3": "pick up the puck and place it onto the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "push the window open",
    "window-close-v3": "push the window closed",
}

ALL_TASKS: tuple[str, ...] = tuple(INSTRUCTIONS)
MT10_TASKS: tuple[str, ...] = (
    "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
    "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3",
)

_FRAME = ("hand_x", "hand_y", "hand_z", "gripper_opening",
          "obj0_x", "obj0_y", "obj0_z", "obj0_qw", "obj0_qx", "obj0_qy", "obj0_qz",
          "obj1_x", "obj1_y", "obj1_z", "obj1_qw", "obj1_qx", "obj1_qy", "obj1_qz")
STATE_NAMES: tuple[str, ...] = (*_FRAME, *(f"prev_{n}" for n in _FRAME), "goal_x", "goal_y", "goal_z")
PIXEL_STATE_NAMES: tuple[str, ...] = STATE_NAMES[:-3]
"""A pixel suite's state: everything but the goal (MetaWorld puts it last)."""
ACTION_NAMES: tuple[str, ...] = ("hand_dx", "hand_dy", "hand_dz", "gripper_effort")


def _task_rng(task: str, seed: int) -> np.random.Generator:
    """The generator MetaWorld draws the initial state from, for one (task, seed)."""
    return np.random.default_rng([zlib.crc32(task.encode()), seed])


class MetaWorldEnv(EpisodeEnv):
    """One MetaWorld v3 task, reset from a seed; a pixel suite's state lacks the goal."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        env = ALL_V3_ENVIRONMENTS[self.task]()
        # The multi-task setting of metaworld.MT1/MT10/MT50, without their Task
        # objects: the goal is part of the observation, and every reset draws a new
        # initial state from env.np_random (which _reset seeds) instead of replaying
        # one of 50 pre-drawn states or touching NumPy's global RNG.
        env._partially_observable = False
        if "sawyer_observation_space" in env.__dict__:  # a cached_property computed as goal-hidden
            del env.sawyer_observation_space
        env._set_task_called = True
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True
        env.max_path_length = self.max_steps
        self._env = env
        # The policy sees the suite's first state_dim values (a pixel suite: all but the
        # goal, which comes last); the expert sees all of _full_state.
        self._state_dim = suite.state_dim
        self._full_state: np.ndarray | None = None
        self._renderers: dict[tuple[int, int], Any] = {}  # (height, width) -> mujoco.Renderer
        if suite.rendering:
            _enlarge_goal_marker(env.model)

    def _observation(self, state: np.ndarray) -> SimObservation:
        self._full_state = state
        return canonical_observation(state[:self._state_dim], self.task)

    def _reset(self, seed: int) -> SimObservation:
        import mujoco

        self._env.np_random = _task_rng(self.task, seed)
        state, _ = self._env.reset()
        # MetaWorld moves the goal site after its last kinematics pass, so the first frame would show the
        # previous episode's goal; positions only (no dynamics), so the physics is unchanged
        mujoco.mj_kinematics(self._env.model, self._env.data)
        return self._observation(state)

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        state, reward, _, _, info = self._env.step(action)
        success = bool(info.get("success", 0.0))
        return self._observation(state), float(reward), success, {
            k: float(v) for k, v in info.items() if isinstance(v, int | float | np.floating | np.integer)}

    def expert_observation(self) -> SimObservation:
        """The full 39-value state, goal included (what MetaWorld's scripted policies read)."""
        if self._full_state is None:
            raise RuntimeError(f"{self.suite.name}/{self.task}: no episode has started; call reset() first")
        return canonical_observation(self._full_state, self.task)

    def hidden_state(self) -> tuple[tuple[str, ...], np.ndarray] | None:
        """A pixel suite's goal (``goal_x``, ``goal_y``, ``goal_z``): the state values the policy is not shown."""
        if self._full_state is None:
            raise RuntimeError(f"{self.suite.name}/{self.task}: no episode has started; call reset() first")
        if self._state_dim >= len(self._full_state):
            return None
        return STATE_NAMES[self._state_dim:], np.asarray(self._full_state[self._state_dim:], dtype=np.float32)

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        import mujoco

        renderer = self._renderer(height, width)
        mujoco_camera, upside_down = _MUJOCO_CAMERAS[camera]
        renderer.update_scene(self._env.data, camera=mujoco_camera)
        renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
        renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
        frame = renderer.render()  # a new array, rows top first (mujoco.Renderer flips OpenGL's rows)
        return np.ascontiguousarray(frame[::-1, ::-1]) if upside_down else frame

    def _renderer(self, height: int, width: int) -> Any:
        renderer = self._renderers.get((height, width))
        if renderer is None:
            renderer = offscreen_renderer(self._env.model, height, width, f"{self.suite.name}/{self.task}")
            self._renderers[(height, width)] = renderer
        return renderer

    def render_frame(self, width: int = 160, height: int = 120) -> np.ndarray:
        """The current scene from the overview camera as ``uint8[height, width, 3]`` (for replays).

        Raises ``RenderingUnavailable`` when no OpenGL context can be made: callers that
        treat frames as optional catch ``Exception``.
        """
        return self.render_images({OVERVIEW_CAMERA: (height, width)})[OVERVIEW_CAMERA]

    def _close_renderers(self) -> None:
        renderers, self._renderers = self._renderers, {}
        for renderer in renderers.values():
            try:
                renderer.close()
            except Exception:  # a context that never fully came up may fail to free; it is gone either way
                pass

    def close(self) -> None:
        self._close_renderers()
        self._env.close()


def _enlarge_goal_marker(model: Any) -> None:
    """Draw the ``goal`` site as ``PIXEL_RENDERING`` says, where the task shows one (alpha > 0)."""
    import mujoco

    goal = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, "goal")
    if goal >= 0 and model.site_rgba[goal][3] > 0:
        model.site_size[goal][0] = GOAL_MARKER_RADIUS
        model.site_rgba[goal] = GOAL_MARKER_RGBA


def _make_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return MetaWorldEnv(suite, task, seed)


def _make_expert(suite: Suite, task: str) -> ExpertPolicy:
    from metaworld.policies import ENV_POLICY_MAP

    policy = ENV_POLICY_MAP[task]()
    low, high = suite.action_low_array, suite.action_high_array

    def expert(obs: SimObservation) -> np.ndarray:
        state = np.asarray(obs["state"], dtype=np.float64)
        if state.shape != (len(STATE_NAMES),):
            raise SuiteError(f"{suite.name}/{task}: the expert reads MetaWorld's full {len(STATE_NAMES)}-value "
                             f"state, got {state.shape[0] if state.ndim == 1 else list(state.shape)} values; "
                             "pass it env.expert_observation(), not the policy's observation")
        # MetaWorld's policies warn whenever their P-controller asks for more than the
        # action bounds; the env clips anyway, so the warning is noise in a demo run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            action = policy.get_action(state)
        return np.clip(np.asarray(action, dtype=np.float32), low, high)

    return expert


def _suite(name: str, description: str, tasks: tuple[str, ...], *, pixels: bool = False) -> Suite:
    if pixels:
        description += ("; pixels: the goal position is not in the state (36 values), only the camera "
                        "images show it")
    state_names = PIXEL_STATE_NAMES if pixels else STATE_NAMES
    return Suite(
        name=f"{name}-pixels" if pixels else name,
        simulator="metaworld",
        description=description,
        tasks=tuple(TaskSpec(t, INSTRUCTIONS[t], MAX_STEPS) for t in tasks),
        state_dim=len(state_names),
        action_dim=4,
        action_low=(-1.0,) * 4,
        action_high=(1.0,) * 4,
        fps=FPS,
        env_factory=_make_env,
        expert_factory=_make_expert,
        state_names=state_names,
        action_names=ACTION_NAMES,
        cameras=PIXEL_CAMERAS if pixels else CAMERAS,
        overview_camera=OVERVIEW_CAMERA,
        seed_rule=SEED_RULE,
        rendering=PIXEL_RENDERING if pixels else "",
    )


def suites() -> list[Suite]:
    """The MetaWorld suites: 50 single-task MT1 suites, MT10 and MT50, and their pixel variants
    (50 MT1 and MT10)."""
    out = []
    for pixels in (False, True):
        out += [_suite(f"metaworld-mt1-{task.removesuffix('-v3')}", f"MetaWorld MT1, one task: {INSTRUCTIONS[task]}",
                       (task,), pixels=pixels)
                for task in ALL_TASKS]
        out.append(_suite("metaworld-mt10", "MetaWorld MT10: ten manipulation tasks", MT10_TASKS, pixels=pixels))
    out.append(_suite("metaworld-mt50", "MetaWorld MT50: all fifty manipulation tasks", ALL_TASKS))
    return out
