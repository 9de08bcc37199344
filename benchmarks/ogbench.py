"""OGBench manipulation (``ogbench`` 1.2.2, manipspace, MuJoCo) as EvalForge suites, with its oracles as experts.

Suites, one per OGBench environment, each with OGBench's five fixed evaluation
goals as tasks ``task1`` … ``task5`` (OGBench's ``reset(options={"task_id": i})``):

- ``ogbench-cube-single`` (``cube-single-v0``): a UR5e arm moves one cube to a goal
  pose; 200 steps per episode;
- ``ogbench-scene`` (``scene-v0``): a cube, two lock buttons, a drawer and a window
  (the buttons lock and unlock the drawer and the window); 750 steps;
- ``ogbench-puzzle-3x3`` (``puzzle-3x3-v0``): a 3 × 3 "Lights Out" board, where a
  press toggles a button and its four neighbours; 500 steps.

The step limits are the ``max_episode_steps`` OGBench registers, which its
evaluation runs to. Success is OGBench's ``info["success"]`` after the action
(every object at its goal: cubes within 4 cm, drawer and window within 4 cm,
every button in its goal state), and it ends the episode, as OGBench's
``terminate_at_goal`` does. The instructions are ours (OGBench has no language);
each names OGBench's own task name (``task1_horizontal``, ``task4_put_in_drawer``...).

Observation: OGBench's state observation, as its ``*-v0`` environments return it
(``STATE_NAMES`` per suite, ``_state_names``): the arm (6 joint angles in rad,
6 joint velocities, the pinch point's position, the gripper's yaw as cos/sin,
its opening and pad contact), then each object. Positions are OGBench's scaled
ones, ``(xyz - [0.425, 0, 0]) × 10`` (decimetres from the workspace centre), the
gripper opening × 3, button joints × 120, drawer × 18, window × 15, and button
states are one-hot. Goal handling: OGBench's agents get the goal observation
beside the state; here the five goals are fixed per task, so the task name (the
observation's ``task`` field) names the goal and the state is the observation
alone, never a goal. Action: OGBench's 5 values in [-1, 1]: the pinch point's
displacement (× 5 cm per step along x, y, z), the yaw change (× 0.3 rad) and the
gripper opening change; OGBench clips the resulting target to its workspace.
``fps`` is the control rate, 1 / 0.05 s = 20.

Seed → initial state: OGBench draws the arm's start pose and each goal's small
perturbation (cube ±1 cm and yaw; drawer and window ±1 cm) from the
environment's ``np_random``, which ``reset(seed=seed)`` reseeds (gymnasium's
PCG64 ``SeedSequence``), so a (task, seed) pair is always the same start; the
two unseeded settling steps OGBench takes while it computes the goal
observation are undone before the episode starts (its qpos/qvel are restored)
and leave no trace in the state or frames (tested).

Camera ``front`` (default 64 × 64, OGBench's ``visual-*-v0`` observation size):
OGBench's ``front_pixels`` MuJoCo camera, the table and arm seen from in front,
with the colouring of OGBench's pixel environments (translucent arm, purple
gripper), so it shows what ``visual-cube-single-v0`` and its siblings give their
agents. Rendered only in ``render_images``, with MuJoCo's ``mujoco.Renderer``
(one per size, kept until ``close()``), upright as MuJoCo renders it; physics is
untouched, so a rendered episode plays exactly like an unrendered one.

Experts: OGBench's Markov oracles (``manipspace/oracles/markov``, the ones its
dataset scripts use, ``min_norm=0.4``), each of which solves one subtask
("put the cube here", "press this button", "move the drawer/window there") from
the privileged state OGBench's ``info`` carries. OGBench ships no solver for its
evaluation goals, so the expert chains subtasks: it picks the next unmet one from
the current state (scene: unlock before moving the drawer or window, open the
drawer before putting the cube in, buttons last; puzzle: the presses that solve
the Lights Out board, recomputed after each press) and hands it to the matching
oracle, moving on as soon as the subtask holds and the arm has lifted away (the
oracles' own "move to a random final pose" phase is for dataset diversity and is
skipped). Feed it ``env.expert_observation()``, which adds the simulator facts it
reads under ``"ogbench"``; policies never see them. The oracles draw from NumPy's
global RNG; each subtask's draws come from a generator seeded by (episode seed,
subtask number), with the global state restored after, so demos are reproducible.

``ogbench`` is imported only when an environment is made, and its dataset
helpers (which download) are never called.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# benchmarks.rendering chooses MuJoCo's headless OpenGL backend at import (before MuJoCo
# loads) and holds the renderer-failure advice; OGBench renders through the same MuJoCo.
from benchmarks.rendering import import_triton_before_mesa, offscreen_renderer
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

FPS = 20.0
SEED_RULE = ("seed -> OGBench's reset(seed=seed, options={task_id}), which reseeds the env's np_random "
             "(gymnasium's SeedSequence PCG64) that draws the arm's start pose and the goal's perturbation; "
             "the settling steps of its goal computation undone")
"""Seed → initial state, as ``Suite.seed_rule`` says it (part of every OGBench suite's definition hash)."""
CAMERAS: tuple[CameraSpec, ...] = (
    CameraSpec("front", 64, 64, "the table and the arm from in front (OGBench's pixel observation: translucent "
                                "arm, purple gripper)"),
)
OVERVIEW_CAMERA = "front"
_MUJOCO_CAMERA = "front_pixels"

_ARM = (
    *(f"joint_pos_{j}" for j in ("shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3")),
    *(f"joint_vel_{j}" for j in ("shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3")),
    "effector_x", "effector_y", "effector_z", "effector_yaw_cos", "effector_yaw_sin",
    "gripper_opening", "gripper_contact",
)
_CUBE = ("cube_x", "cube_y", "cube_z", "cube_qw", "cube_qx", "cube_qy", "cube_qz", "cube_yaw_cos", "cube_yaw_sin")


def _button(i: int) -> tuple[str, ...]:
    return (f"button{i}_off", f"button{i}_on", f"button{i}_pos", f"button{i}_vel")


ACTION_NAMES = ("effector_dx", "effector_dy", "effector_dz", "effector_dyaw", "gripper_dopening")


@dataclass(frozen=True)
class _Environment:
    """One OGBench environment: its class, constructor arguments, tasks and state layout."""

    suite: str
    ogbench_id: str
    module: str
    cls: str
    env_type: str
    max_steps: int
    description: str
    instructions: tuple[tuple[str, str], ...]  # (OGBench task name, our instruction), task1 first
    state_names: tuple[str, ...]


ENVIRONMENTS: tuple[_Environment, ...] = (
    _Environment(
        suite="ogbench-cube-single", ogbench_id="cube-single-v0", module="ogbench.manipspace.envs.cube_env",
        cls="CubeEnv", env_type="single", max_steps=200,
        description="OGBench cube-single: a UR5e arm moves one cube to a goal pose (five fixed goals)",
        instructions=(
            ("task1_horizontal", "pick up the red cube and place it 20 cm to the side, on its goal"),
            ("task2_vertical1", "pick up the red cube and place it 15 cm further away from the robot base"),
            ("task3_vertical2", "pick up the red cube and place it 15 cm closer to the robot base"),
            ("task4_diagonal1", "pick up the red cube and carry it diagonally across the table to its goal"),
            ("task5_diagonal2", "pick up the red cube and carry it diagonally the other way across the table "
                                "to its goal"),
        ),
        state_names=(*_ARM, *_CUBE),
    ),
    _Environment(
        suite="ogbench-scene", ogbench_id="scene-v0", module="ogbench.manipspace.envs.scene_env",
        cls="SceneEnv", env_type="scene", max_steps=750,
        description=("OGBench scene: a cube, a drawer and a window, locked and unlocked by two buttons; bring "
                     "everything to a goal configuration (five fixed goals)"),
        instructions=(
            ("task1_open", "open the drawer and the window"),
            ("task2_unlock_and_lock", "unlock the drawer and the window, close both, and lock them again"),
            ("task3_rearrange_medium", "move the cube 20 cm sideways, open the drawer, close the window and "
                                       "leave both buttons unlocked"),
            ("task4_put_in_drawer", "unlock and open the drawer, put the cube in it and close the drawer"),
            ("task5_rearrange_hard", "put the cube in the closed drawer, open the window, and lock both again"),
        ),
        state_names=(*_ARM, *_CUBE, *_button(0), *_button(1),
                     "drawer_pos", "drawer_vel", "window_pos", "window_vel"),
    ),
    _Environment(
        suite="ogbench-puzzle-3x3", ogbench_id="puzzle-3x3-v0", module="ogbench.manipspace.envs.puzzle_env",
        cls="PuzzleEnv", env_type="3x3", max_steps=500,
        description=("OGBench puzzle-3x3: Lights Out on a 3 × 3 board of buttons (a press toggles a button and "
                     "its neighbours); reach the goal pattern (five fixed goals)"),
        instructions=(
            ("task1", "from all buttons off, press buttons until the board shows the goal pattern"),
            ("task2", "from all buttons on, turn only the top-left button off"),
            ("task3", "turn the plus pattern into the X pattern: corners and centre on, edges off"),
            ("task4", "turn every button on, starting from the ring pattern"),
            ("task5", "from all buttons on, turn the middle column off"),
        ),
        state_names=(*_ARM, *(name for i in range(9) for name in _button(i))),
    ),
)
_BY_SUITE = {e.suite: e for e in ENVIRONMENTS}


def _task_id(task: str) -> int:
    """``task3`` → 3 (OGBench's ``task_id``)."""
    return int(task.removeprefix("task"))


class OGBenchEnv(EpisodeEnv):
    """One OGBench manipspace environment playing one of its five evaluation goals."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        import importlib

        # OGBench imports dm_control, whose renderer module loads Mesa's EGL at import: triton
        # must come first (see benchmarks.rendering.import_triton_before_mesa).
        import_triton_before_mesa()
        spec = _BY_SUITE[suite.name]
        env_class = getattr(importlib.import_module(spec.module), spec.cls)
        # The arguments gym.make(spec.ogbench_id) passes: task mode, state observations,
        # success after the action, terminate at the goal.
        self._env = env_class(env_type=spec.env_type)
        self._task_id = _task_id(self.task)
        self._info: dict[str, Any] = {}
        self._renderers: dict[tuple[int, int], Any] = {}
        self._pixel_colours_applied = False

    def _reset(self, seed: int) -> SimObservation:
        with warnings.catch_warnings():
            # OGBench's float64 action Box warns about its float32 cast whenever it is sampled.
            warnings.simplefilter("ignore")
            state, info = self._env.reset(seed=seed, options={"task_id": self._task_id})
        self._info = info
        return canonical_observation(state, self.task)

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        state, reward, _, _, info = self._env.step(action.astype(np.float64))
        self._info = info
        return canonical_observation(state, self.task), float(reward), bool(info["success"]), {}

    def expert_observation(self) -> SimObservation:
        """The policy's observation plus ``"ogbench"``: OGBench's info (privileged object state),
        the simulator facts the oracles read, the goal, the episode's seed and step."""
        obs = super().expert_observation()
        env, data = self._env, self._env.data
        facts: dict[str, Any] = {
            "info": self._info,
            "seed": self.seed,
            "step": self.steps,
            "arm_sampling_bounds": env._arm_sampling_bounds.copy(),
            "goal": env.cur_task_info,
        }
        if hasattr(env, "_button_site_ids"):
            facts["button_top_pos"] = data.site_xpos[env._button_site_ids].copy()
        if hasattr(env, "_drawer_site_id"):
            model = env.model
            facts["drawer_axis"] = data.xaxis[model.joint("drawer_slide").id].copy()
            facts["window_axis"] = data.xaxis[model.joint("window_slide").id].copy()
        return {**obs, "ogbench": facts}

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        renderer = self._renderer(height, width)
        renderer.update_scene(self._env.data, camera=_MUJOCO_CAMERA)
        return renderer.render()  # a new C-contiguous array, rows top first

    def _renderer(self, height: int, width: int) -> Any:
        renderer = self._renderers.get((height, width))
        if renderer is None:
            if not self._pixel_colours_applied:
                _apply_pixel_colours(self._env)
                self._pixel_colours_applied = True
            renderer = offscreen_renderer(self._env.model, height, width, f"{self.suite.name}/{self.task}")
            self._renderers[(height, width)] = renderer
        return renderer

    def close(self) -> None:
        renderers, self._renderers = self._renderers, {}
        for renderer in renderers.values():
            try:
                renderer.close()
            except Exception:  # a context that never fully came up may fail to free; it is gone either way
                pass
        self._env.close()


# What ManipSpaceEnv.build_mjcf_model changes for ob_type="pixels" (OGBench 1.2.2), applied to the
# compiled model: our env observes states, but its camera shows what OGBench's pixel agents see.
_PURPLE_MATERIALS = ("ur5e/robotiq/black", "ur5e/robotiq/pad_gray")
_TRANSLUCENT_MATERIALS = {
    "ur5e/robotiq/metal": 0.1, "ur5e/robotiq/silicone": 0.1, "ur5e/robotiq/gray": 0.1,
    "ur5e/robotiq/black": 0.1, "ur5e/robotiq/pad_gray": 0.5, "ur5e/black": 0.1, "ur5e/jointgray": 0.1,
    "ur5e/linkgray": 0.1, "ur5e/lightblue": 0.1,
}


def _apply_pixel_colours(env: Any) -> None:
    """OGBench's pixel-environment colouring on a compiled model (materials only: physics is untouched)."""
    model = env.model
    for name in _PURPLE_MATERIALS:
        model.material(name).rgba[:] = env._colors["purple"]
    for name, alpha in _TRANSLUCENT_MATERIALS.items():
        model.material(name).rgba[3] = alpha


def _make_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return OGBenchEnv(suite, task, seed)


# --------------------------------------------------------------------------- experts


@contextlib.contextmanager
def _numpy_global_seed(seed: int, subtask: int) -> Iterator[None]:
    """Seed NumPy's global RNG (which OGBench's oracles draw from) for one subtask; restore it after."""
    saved = np.random.get_state()
    np.random.seed(np.random.SeedSequence([seed, subtask]).generate_state(1)[0])
    try:
        yield
    finally:
        np.random.set_state(saved)


@dataclass(frozen=True)
class _OracleEnv:
    """What a Markov oracle reads from its ``env``: ``env.unwrapped._arm_sampling_bounds``."""

    _arm_sampling_bounds: np.ndarray

    @property
    def unwrapped(self) -> _OracleEnv:
        return self


@dataclass(frozen=True)
class _Subtask:
    """One oracle's job: ``kind`` is cube/button/drawer/window; ``target`` the info keys it adds."""

    kind: str
    target: dict[str, Any]
    lift: float  # the oracle's "above" height: the subtask is over once it holds and the hand is this high

    def holds(self, info: dict[str, Any]) -> bool:
        if self.kind == "cube":
            released = info["proprio/gripper_contact"][0] < 0.1
            return released and np.linalg.norm(info["privileged/block_0_pos"] - self.target["privileged/target_block_pos"]) <= 0.04
        if self.kind == "button":
            button = self.target["privileged/target_button"]
            return info["button_states"][button] == self.target["privileged/target_button_state"]
        handle = info[f"privileged/{self.kind}_handle_pos"]
        return np.linalg.norm(handle - self.target[f"privileged/target_{self.kind}_handle_pos"]) <= 0.01


CUBE_GOAL_TOLERANCE = 0.04  # OGBench's success distance for a cube, a drawer and a window
DRAWER_OPEN = -0.12  # OGBench's data collection treats the drawer as open below this slide position


def _cube_subtask(target_pos: np.ndarray) -> _Subtask:
    # OGBench's goals hold the cube unrotated (yaw 0); success ignores the yaw.
    return _Subtask("cube", {"privileged/target_block": 0, "privileged/target_block_pos": np.asarray(target_pos),
                             "privileged/target_block_yaw": np.zeros(1)}, lift=0.16)


def _button_subtask(button: int, facts: dict[str, Any]) -> _Subtask:
    state = int(facts["info"]["button_states"][button])
    return _Subtask("button", {"privileged/target_button": button, "privileged/target_button_state": 1 - state,
                               "privileged/target_button_top_pos": facts["button_top_pos"][button]}, lift=0.16)


def _slide_subtask(kind: str, position: float, facts: dict[str, Any]) -> _Subtask:
    """Move the drawer or the window (``kind``) to slide ``position``."""
    info = facts["info"]
    now = info[f"privileged/{kind}_pos"][0]
    target_handle = info[f"privileged/{kind}_handle_pos"] + facts[f"{kind}_axis"] * (position - now)
    return _Subtask(kind, {f"privileged/target_{kind}_handle_pos": target_handle},
                    lift=0.18 if kind == "drawer" else 0.28)


def _next_cube_subtask(facts: dict[str, Any]) -> _Subtask | None:
    goal = facts["goal"]["goal_xyzs"][0]
    if np.linalg.norm(facts["info"]["privileged/block_0_pos"] - goal) <= CUBE_GOAL_TOLERANCE:
        return None
    return _cube_subtask(goal)


def _next_scene_subtask(facts: dict[str, Any]) -> _Subtask | None:
    """The next unmet part of a scene goal, unlocking what must move first."""
    info, goal = facts["info"], facts["goal"]["goal"]
    buttons = info["button_states"]
    drawer, window = info["privileged/drawer_pos"][0], info["privileged/window_pos"][0]
    cube = info["privileged/block_0_pos"]
    cube_goal = goal["block_xyzs"][0]
    # A goal inside the drawer (its floor is above the table) moves with the drawer.
    in_drawer = cube_goal[2] > 0.04
    cube_target = cube_goal + facts["drawer_axis"] * (drawer - goal["drawer_pos"]) if in_drawer else cube_goal
    if np.linalg.norm(cube - cube_target) > CUBE_GOAL_TOLERANCE:
        if in_drawer and drawer > DRAWER_OPEN:
            return _button_subtask(0, facts) if buttons[0] == 0 else _slide_subtask("drawer", -0.16, facts)
        return _cube_subtask(cube_target)
    if abs(drawer - goal["drawer_pos"]) > CUBE_GOAL_TOLERANCE / 2:
        return _button_subtask(0, facts) if buttons[0] == 0 else _slide_subtask("drawer", goal["drawer_pos"], facts)
    if abs(window - goal["window_pos"]) > CUBE_GOAL_TOLERANCE / 2:
        return _button_subtask(1, facts) if buttons[1] == 0 else _slide_subtask("window", goal["window_pos"], facts)
    for button, (state, wanted) in enumerate(zip(buttons, goal["button_states"], strict=True)):
        if state != wanted:
            return _button_subtask(button, facts)
    return None


def lights_out_presses(states: np.ndarray, goal: np.ndarray, rows: int, cols: int) -> list[int]:
    """The fewest buttons whose presses turn ``states`` into ``goal`` on a rows × cols Lights Out board
    (a press toggles the button and its four neighbours), row-major; ``[]`` when none is needed.
    Exhaustive over the 2^(rows·cols) press sets: 512 on 3 × 3."""
    n = rows * cols
    toggles = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        r, c = divmod(i, cols)
        for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
            if 0 <= r + dr < rows and 0 <= c + dc < cols:
                toggles[i, (r + dr) * cols + c + dc] = 1
    wanted = (np.asarray(states) + np.asarray(goal)) % 2
    for count in range(n + 1):
        for presses in itertools.combinations(range(n), count):
            if np.array_equal(toggles[list(presses)].sum(axis=0) % 2, wanted):
                return list(presses)
    raise ValueError(f"no presses turn {list(states)} into {list(goal)} on a {rows}×{cols} board")


def _next_puzzle_subtask(facts: dict[str, Any]) -> _Subtask | None:
    info = facts["info"]
    presses = lights_out_presses(info["button_states"], facts["goal"]["goal_button_states"], 3, 3)
    if not presses:
        return None
    effector = info["proprio/effector_pos"]
    nearest = min(presses, key=lambda b: np.linalg.norm(facts["button_top_pos"][b][:2] - effector[:2]))
    return _button_subtask(nearest, facts)


_PLANNERS = {"ogbench-cube-single": _next_cube_subtask, "ogbench-scene": _next_scene_subtask,
             "ogbench-puzzle-3x3": _next_puzzle_subtask}


class OGBenchExpert:
    """OGBench's Markov oracles chained over the subtasks of an evaluation goal; see the module docstring."""

    def __init__(self, suite: Suite, task: str) -> None:
        from ogbench.manipspace.oracles.markov.button_markov import ButtonMarkovOracle
        from ogbench.manipspace.oracles.markov.cube_markov import CubeMarkovOracle
        from ogbench.manipspace.oracles.markov.drawer_markov import DrawerMarkovOracle
        from ogbench.manipspace.oracles.markov.window_markov import WindowMarkovOracle

        self._suite, self._task = suite, task
        self._next_subtask = _PLANNERS[suite.name]
        # OGBench's dataset scripts: the puzzle presses with the gripper closed, the scene's cube
        # oracle gives up after 100 steps (it is retried from the new state).
        self._oracle_classes = {
            "cube": lambda env: CubeMarkovOracle(env=env, max_step=100 if suite.name == "ogbench-scene" else 200),
            "button": lambda env: ButtonMarkovOracle(env=env,
                                                     gripper_always_closed=suite.name == "ogbench-puzzle-3x3"),
            "drawer": lambda env: DrawerMarkovOracle(env=env),
            "window": lambda env: WindowMarkovOracle(env=env),
        }
        self._episode: tuple[int, int] | None = None  # (seed, step) last seen
        self._subtask: _Subtask | None = None
        self._oracle: Any = None
        self._subtasks_started = 0

    def __call__(self, obs: SimObservation) -> np.ndarray:
        facts = obs.get("ogbench")
        if facts is None:
            raise SuiteError(f"{self._suite.name}/{self._task}: the expert reads OGBench's privileged state; pass "
                             "it env.expert_observation(), not the policy's observation")
        if self._episode is None or facts["step"] == 0 or facts["seed"] != self._episode[0]:
            self._subtask, self._oracle, self._subtasks_started = None, None, 0
        self._episode = (facts["seed"], facts["step"])
        info = facts["info"]
        if self._subtask is None or self._oracle.done or (
                self._subtask.holds(info) and info["proprio/effector_pos"][2] > self._subtask.lift):
            self._start_next_subtask(obs, facts)
        if self._subtask is None:  # the goal holds; OGBench ends the episode on the step that reached it
            return np.zeros(self._suite.action_dim, dtype=np.float32)
        full_info = {**info, **self._subtask.target}
        with _numpy_global_seed(facts["seed"], self._subtasks_started):
            action = self._oracle.select_action(obs["state"], full_info)
        return np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)

    def _start_next_subtask(self, obs: SimObservation, facts: dict[str, Any]) -> None:
        self._subtask = self._next_subtask(facts)
        if self._subtask is None:
            return
        self._subtasks_started += 1
        self._oracle = self._oracle_classes[self._subtask.kind](_OracleEnv(facts["arm_sampling_bounds"]))
        with _numpy_global_seed(facts["seed"], self._subtasks_started):
            self._oracle.reset(obs["state"], {**facts["info"], **self._subtask.target})


def _make_expert(suite: Suite, task: str) -> ExpertPolicy:
    return OGBenchExpert(suite, task)


def suites() -> list[Suite]:
    """The three OGBench manipulation suites."""
    return [Suite(
        name=spec.suite,
        simulator="ogbench",
        description=f"{spec.description}; OGBench {spec.ogbench_id}",
        tasks=tuple(TaskSpec(f"task{i}", f"{instruction} (OGBench {name})", spec.max_steps)
                    for i, (name, instruction) in enumerate(spec.instructions, start=1)),
        state_dim=len(spec.state_names),
        action_dim=5,
        action_low=(-1.0,) * 5,
        action_high=(1.0,) * 5,
        fps=FPS,
        env_factory=_make_env,
        expert_factory=_make_expert,
        state_names=spec.state_names,
        action_names=ACTION_NAMES,
        cameras=CAMERAS,
        overview_camera=OVERVIEW_CAMERA,
        seed_rule=SEED_RULE,
    ) for spec in ENVIRONMENTS]
