"""ALOHA (gym-aloha 0.1.5: dm_control + MuJoCo, two ViperX arms) as the EvalForge suites
``aloha-transfer-cube`` and ``aloha-insertion``, with ACT's scripted experts.

Tasks (one per suite, both from ACT, Zhao et al. 2023, as gym-aloha ships them):

- ``transfer-cube``: the right arm picks up the red cube and hands it to the left arm;
- ``insertion``: the left arm picks up the blue socket, the right arm the red peg, and
  they insert the peg into the socket in mid-air.

The instructions are the task strings of LeRobot's ``lerobot/aloha_sim_*`` datasets, so a
language-conditioned policy trained on them reads the sentence it was trained with.

Observation: gym-aloha's 14-value ``agent_pos`` (``STATE_NAMES``): per arm, left first,
six joint angles (radians: waist, shoulder, elbow, forearm roll, wrist angle, wrist
rotate) and the gripper opening, normalised to 0 closed … 1 open. Action (14 values,
``ACTION_NAMES``): the same joints' target positions for the arms' position servos and
the normalised gripper targets. Bounds (``ACTION_LOW``/``ACTION_HIGH``) are the arms'
actuator ranges in gym-aloha's MJCF and [0, 1] for the grippers; gym-aloha's own
``action_space`` says [-1, 1] for everything, which would cut off most of the arms'
range (the start pose has the elbow at 1.16 rad), so it is not used.

Episodes: 400 steps at 50 steps/s, ACT's episode length for both tasks (and LeRobot's
``episode_length``; gym-aloha's gymnasium registration says 300, too short for ACT's
scripted insertion). Success is the task's top reward, 4 (cube held by the left
gripper off the table; peg touching the socket's pin), as gym-aloha terminates on it,
and ends the episode.

Seed → initial state: gym-aloha's own ``sample_box_pose(seed)`` /
``sample_insertion_pose(seed)`` (a fresh ``numpy.random.RandomState(seed)``, so seeds
must be below 2**32), the arms at ACT's start pose. A seed names the same object poses
here as ``gym_aloha``'s ``reset(seed=seed)``, and the physics matches gym-aloha's step
for step (tested), so LeRobot's gym-aloha evaluations and ours start alike.

Stepping never renders. gym-aloha's environment renders three 480 × 640 cameras at
every step and reset (~0.2 s per step here, against ~0.3 ms of physics); this module
drives gym-aloha's task objects (their action mapping, reward and state read-out) on
its MJCF models directly, without dm_control's ``control.Environment`` loop, whose
observation is what renders.

Camera ``top`` (default 240 × 320, half of gym-aloha's 480 × 640 in each direction, the
same aspect): gym-aloha's camera, the table from above with the arms entering from the
left and right and the far side of the table at the top of the picture. It is rendered
only by ``render_images``, with the very call gym-aloha makes
(``physics.render(height, width, camera_id="top")``, shadows on), so at 480 × 640 a
frame is byte for byte gym-aloha's ``top`` observation (tested): a policy trained on
gym-aloha's images sees the same pictures. The shadow pass (MJCF shadow map 4096²) is
most of the cost and does not shrink with the frame (see docs/benchmarks.md).

Scripted experts: ACT's ``PickAndTransferPolicy`` and ``InsertionPolicy`` plan
end-effector waypoints from the initial object poses and run on gym-aloha's
end-effector (mocap) variants of the tasks; exactly as ACT's ``record_sim_episodes.py``
does, the expert records that run's joint positions (with the commanded gripper
openings in place of the measured ones) and replays them, step by step, as joint
commands in the ordinary task. ``expert(env.expert_observation())`` plans on first use
for a new initial pose (one 400-step mocap run, ~0.2 s) and then returns the recorded
command of the observation's step: ``expert_observation()`` carries, besides the
state, ``initial_object_pose`` (the ``qpos`` of the cube, or of the peg then the socket,
at reset) and ``step`` (steps taken so far). Neither is sent to policies.

gym-aloha and dm_control are imported only when an environment or expert is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# benchmarks.rendering chooses MuJoCo's headless OpenGL backend (MUJOCO_GL) on import, before
# dm_control or mujoco is imported, and holds the rendering guards every MuJoCo simulator needs.
from benchmarks.rendering import RenderingUnavailable, import_triton_before_mesa, no_context_advice
from benchmarks.suite import (
    MAX_IMAGE_SIDE,
    CameraSpec,
    EpisodeEnv,
    ExpertPolicy,
    SimObservation,
    Suite,
    SuiteError,
    TaskSpec,
    canonical_observation,
)

TRANSFER_CUBE = "transfer-cube"
INSERTION = "insertion"
MAX_STEPS = 400
FPS = 50.0
SEED_RULE = ("seed (< 2**32) -> gym-aloha's sample_box_pose(seed) / sample_insertion_pose(seed) (a fresh "
             "numpy.random.RandomState(seed)) for the objects' poses; the arms at ACT's start pose")
"""Seed → initial state, as ``Suite.seed_rule`` says it (part of every ALOHA suite's definition hash)."""
SUCCESS_REWARD = 4

INSTRUCTIONS: dict[str, str] = {
    TRANSFER_CUBE: "Pick up the cube with the right arm and transfer it to the left arm.",
    INSERTION: "Insert the peg into the socket.",
}

# Task -> (gym-aloha's joint-control MJCF, its end-effector (mocap) MJCF).
_MODELS: dict[str, tuple[str, str]] = {
    TRANSFER_CUBE: ("bimanual_viperx_transfer_cube.xml", "bimanual_viperx_end_effector_transfer_cube.xml"),
    INSERTION: ("bimanual_viperx_insertion.xml", "bimanual_viperx_end_effector_insertion.xml"),
}

_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
STATE_NAMES: tuple[str, ...] = tuple(f"{arm}_arm_{joint}" for arm in ("left", "right") for joint in _JOINTS)
"""gym-aloha's ``JOINTS``: left arm then right arm, six joints and the normalised gripper each."""
ACTION_NAMES: tuple[str, ...] = STATE_NAMES

# The arms' actuator ctrlrange in gym-aloha's MJCF (radians), gripper targets normalised to [0, 1].
_ARM_LOW = (-3.14158, -1.85005, -1.76278, -3.14158, -1.8675, -3.14158)
_ARM_HIGH = (3.14158, 1.25664, 1.6057, 3.14158, 2.23402, 3.14158)
ACTION_LOW: tuple[float, ...] = (*_ARM_LOW, 0.0, *_ARM_LOW, 0.0)
ACTION_HIGH: tuple[float, ...] = (*_ARM_HIGH, 1.0, *_ARM_HIGH, 1.0)

CAMERAS: tuple[CameraSpec, ...] = (
    CameraSpec("top", 240, 320, "the table from above: the arms enter from the left and right, the far side is up"),
)
OVERVIEW_CAMERA = "top"

_ARM_QPOS = 16  # qpos of the two arms (6 joints + 2 fingers each); the objects' free joints follow
_SEED_LIMIT = 2**32  # numpy.random.RandomState, which gym-aloha's pose samplers use, takes seeds below it


def _initial_object_pose(task: str, seed: int) -> np.ndarray:
    """The objects' free-joint qpos that ``seed`` names: gym-aloha's own samplers, as its reset uses them."""
    from gym_aloha.utils import sample_box_pose, sample_insertion_pose

    if seed >= _SEED_LIMIT:
        raise ValueError(f"aloha/{task}: seed {seed} is too large; gym-aloha draws object poses with "
                         f"numpy.random.RandomState, which takes seeds below 2**32 = {_SEED_LIMIT}")
    if task == TRANSFER_CUBE:
        return np.asarray(sample_box_pose(seed), dtype=np.float64)
    return np.concatenate(sample_insertion_pose(seed)).astype(np.float64)


def _load_physics(xml_name: str) -> Any:
    """A dm_control ``Physics`` of one of gym-aloha's MJCF files."""
    # dm_control brings up its OpenGL platform (Mesa's EGL, and with it Mesa's LLVM) when it is
    # imported, not at the first render, so triton must be imported before dm_control is.
    import_triton_before_mesa()
    from dm_control import mujoco as dm_mujoco
    from gym_aloha.constants import ASSETS_DIR

    return dm_mujoco.Physics.from_xml_path(str(ASSETS_DIR / xml_name))


def _substeps(physics: Any) -> int:
    """Physics steps per control step: gym-aloha's DT (0.02 s) over the MJCF timestep, as dm_control computes it."""
    from gym_aloha.constants import DT

    return int(round(DT / physics.timestep()))


class AlohaEnv(EpisodeEnv):
    """One gym-aloha task with joint-position control, reset from a seed, rendering only on request."""

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        super().__init__(suite, task, seed)
        self._physics = _load_physics(_MODELS[self.task][0])  # first: it imports dm_control safely
        from gym_aloha.tasks.sim import InsertionTask, TransferCubeTask

        # gym-aloha's task object maps our 14 values onto the 16 actuators, reads agent_pos and
        # scores contacts; its get_observation (which renders three cameras) is never called.
        self._sim_task = TransferCubeTask() if self.task == TRANSFER_CUBE else InsertionTask()
        self._substeps = _substeps(self._physics)
        # Any frame size up to the suite's limit; the offscreen buffer is allocated at the first render.
        vis = self._physics.model.vis.global_
        vis.offwidth, vis.offheight = max(vis.offwidth, MAX_IMAGE_SIDE), max(vis.offheight, MAX_IMAGE_SIDE)
        self._rendered = False
        self._initial_object_pose = np.zeros(0)

    def _reset(self, seed: int) -> SimObservation:
        from gym_aloha.constants import START_ARM_POSE

        pose = _initial_object_pose(self.task, seed)
        physics = self._physics
        # What gym-aloha's TransferCubeTask/InsertionTask.initialize_episode do, with the pose
        # passed in rather than through their module-global BOX_POSE.
        with physics.reset_context():
            physics.named.data.qpos[:_ARM_QPOS] = START_ARM_POSE
            np.copyto(physics.data.ctrl, START_ARM_POSE)
            physics.data.qpos[_ARM_QPOS:] = pose
        # gym-aloha sets the pose in a reset context nested in dm_control's, so its first state has been
        # through mj_forward twice, the second warm-started by the first; so has ours, bit for bit.
        physics.forward()
        self._initial_object_pose = pose
        return self._observation()

    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        # dm_control's control.Environment.step without its observation (the part that renders).
        self._sim_task.before_step(action.astype(np.float64), self._physics)
        self._physics.step(self._substeps)
        self._sim_task.after_step(self._physics)
        reward = int(self._sim_task.get_reward(self._physics))
        return self._observation(), float(reward), reward == SUCCESS_REWARD, {}

    def _observation(self) -> SimObservation:
        return canonical_observation(self._sim_task.get_qpos(self._physics), self.task)

    def expert_observation(self) -> SimObservation:
        """The state, plus what the scripted expert reads: the objects' initial pose and the step index."""
        return {**super().expert_observation(), "initial_object_pose": self._initial_object_pose.copy(),
                "step": self.steps}

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        try:
            frame = self._physics.render(height=height, width=width, camera_id=camera)
        except Exception as exc:  # what each backend raises without a display or a GL library varies
            if self._rendered:
                raise
            raise RenderingUnavailable(f"{self.suite.name}/{self.task}: {no_context_advice(exc)}") from exc
        self._rendered = True
        return np.ascontiguousarray(frame)  # dm_control returns the buffer flipped upright, as a view

    def close(self) -> None:
        self._physics.free()


# --------------------------------------------------------------------------- ACT's scripted experts

_Waypoint = tuple[int, np.ndarray, np.ndarray, float]
"""(step, gripper position xyz, gripper quaternion wxyz, gripper opening 0..1): one of ACT's waypoints."""


def _axis_angle_quaternion(axis: Sequence[float], degrees: float) -> np.ndarray:
    """The unit quaternion (w, x, y, z) of a rotation by ``degrees`` about the unit ``axis``
    (``pyquaternion.Quaternion(axis=..., degrees=...)``)."""
    half = np.radians(degrees) / 2
    return np.concatenate([[np.cos(half)], np.sin(half) * np.asarray(axis, dtype=np.float64)])


def _quaternion_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Hamilton product ``a * b`` of two (w, x, y, z) quaternions."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return np.array([aw * bw - ax * bx - ay * by - az * bz,
                     aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw])


def _transfer_cube_waypoints(objects: np.ndarray, left: np.ndarray, right: np.ndarray
                             ) -> tuple[list[_Waypoint], list[_Waypoint]]:
    """ACT's ``PickAndTransferPolicy.generate_trajectory``: the right gripper picks the cube and
    brings it to a meeting point in mid-air, where the left gripper takes it over."""
    box = objects[:3]
    pick = _quaternion_product(right[3:], _axis_angle_quaternion([0.0, 1.0, 0.0], -60))
    meet_left = _axis_angle_quaternion([1.0, 0.0, 0.0], 90)
    meet = np.array([0.0, 0.5, 0.25])
    upright = np.array([1.0, 0.0, 0.0, 0.0])
    left_path = [
        (0, left[:3], left[3:], 0.0),                                 # sleep
        (100, meet + [-0.1, 0, -0.02], meet_left, 1.0),               # approach the meeting point
        (260, meet + [0.02, 0, -0.02], meet_left, 1.0),               # move to it
        (310, meet + [0.02, 0, -0.02], meet_left, 0.0),               # close the gripper
        (360, meet + [-0.1, 0, -0.02], upright, 0.0),                 # move left
        (400, meet + [-0.1, 0, -0.02], upright, 0.0),                 # stay
    ]
    right_path = [
        (0, right[:3], right[3:], 0.0),                               # sleep
        (90, box + [0, 0, 0.08], pick, 1.0),                          # approach the cube
        (130, box + [0, 0, -0.015], pick, 1.0),                       # go down
        (170, box + [0, 0, -0.015], pick, 0.0),                       # close the gripper
        (200, meet + [0.05, 0, 0], pick, 0.0),                        # approach the meeting point
        (220, meet, pick, 0.0),                                       # move to it
        (310, meet, pick, 1.0),                                       # open the gripper
        (360, meet + [0.1, 0, 0], pick, 1.0),                         # move right
        (400, meet + [0.1, 0, 0], pick, 1.0),                         # stay
    ]
    return left_path, right_path


def _insertion_waypoints(objects: np.ndarray, left: np.ndarray, right: np.ndarray
                         ) -> tuple[list[_Waypoint], list[_Waypoint]]:
    """ACT's ``InsertionPolicy.generate_trajectory``: the left gripper picks the socket, the right
    the peg, and both meet in mid-air, pushing the peg into the socket."""
    peg, socket = objects[:3], objects[7:10]
    # ACT turns both grippers from the *right* gripper's initial orientation; both start upright.
    pick_right = _quaternion_product(right[3:], _axis_angle_quaternion([0.0, 1.0, 0.0], -60))
    pick_left = _quaternion_product(right[3:], _axis_angle_quaternion([0.0, 1.0, 0.0], 60))
    meet = np.array([0.0, 0.5, 0.15])
    lift_right = 0.00715
    left_path = [
        (0, left[:3], left[3:], 0.0),                                 # sleep
        (120, socket + [0, 0, 0.08], pick_left, 1.0),                 # approach the socket
        (170, socket + [0, 0, -0.03], pick_left, 1.0),                # go down
        (220, socket + [0, 0, -0.03], pick_left, 0.0),                # close the gripper
        (285, meet + [-0.1, 0, 0], pick_left, 0.0),                   # approach the meeting point
        (340, meet + [-0.05, 0, 0], pick_left, 0.0),                  # insertion
        (400, meet + [-0.05, 0, 0], pick_left, 0.0),                  # stay
    ]
    right_path = [
        (0, right[:3], right[3:], 0.0),                               # sleep
        (120, peg + [0, 0, 0.08], pick_right, 1.0),                   # approach the peg
        (170, peg + [0, 0, -0.03], pick_right, 1.0),                  # go down
        (220, peg + [0, 0, -0.03], pick_right, 0.0),                  # close the gripper
        (285, meet + [0.1, 0, lift_right], pick_right, 0.0),          # approach the meeting point
        (340, meet + [0.05, 0, lift_right], pick_right, 0.0),         # insertion
        (400, meet + [0.05, 0, lift_right], pick_right, 0.0),         # stay
    ]
    return left_path, right_path


_WAYPOINTS = {TRANSFER_CUBE: _transfer_cube_waypoints, INSERTION: _insertion_waypoints}


def _interpolate(path: list[_Waypoint], step: int) -> np.ndarray:
    """ACT's ``BasePolicy.interpolate`` at ``step``: position, quaternion (component-wise, as ACT does)
    and gripper, linear between the waypoints around it; 8 values."""
    for (t0, xyz0, quat0, grip0), (t1, xyz1, quat1, grip1) in zip(path, path[1:], strict=False):
        if t0 <= step < t1:
            frac = (step - t0) / (t1 - t0)
            return np.concatenate([xyz0 + (xyz1 - xyz0) * frac, quat0 + (quat1 - quat0) * frac,
                                   [grip0 + (grip1 - grip0) * frac]])
    raise ValueError(f"step {step} lies outside the scripted trajectory (steps {path[0][0]} to {path[-1][0] - 1})")


def _restore_mujoco2_mocap_welds(physics: Any) -> None:
    """Make the mocap welds pull the grippers as they did under MuJoCo 2, which ACT's waypoints were tuned on.

    MuJoCo 3.0 changed ``mj_diagApprox`` (change 34 of its changelog): a weld's three rotation
    rows now get the body's rotational inverse weight, where MuJoCo 2 gave all six rows the
    translational one. The rows' regularisation (R = (1 - imp) / imp * diagApprox) grew by
    invweight_rot / invweight_trans (~400 for a ViperX gripper), the grippers lag their mocap
    orientation, and ACT's scripted policies miss the objects (0-1 of 10 transfers here, as in
    ACT's issues #37 and #45). Scaling the rotation rows by torquescale = sqrt(invweight_rot /
    invweight_trans) scales their A = J M^-1 J' by that ratio and leaves R as it is, which gives
    back MuJoCo 2's R / A for a weld to a mocap body (infinite mass, no inverse weight of its own);
    MetaWorld fixed its mocap weld the same way (a torquescale, in its MuJoCo 3 port). Touches
    only the end-effector model, which no policy is evaluated in.
    """
    import mujoco

    if int(mujoco.__version__.split(".")[0]) < 3:
        return
    model = physics.model
    for weld in range(model.neq):
        if model.eq_type[weld] == mujoco.mjtEq.mjEQ_WELD and model.body_mocapid[model.eq_obj1id[weld]] >= 0:
            translation, rotation = model.body_invweight0[model.eq_obj2id[weld]]
            model.eq_data[weld, 10] = np.sqrt(rotation / translation)


class ScriptedAlohaExpert:
    """ACT's scripted policy for one task, replayed as joint commands (ACT's ``record_sim_episodes.py``).

    For each new initial object pose it runs the end-effector plan on gym-aloha's mocap
    variant of the task with the same objects and records the joint commands; calls
    return the recorded command for the observation's ``step``.
    """

    def __init__(self, suite: Suite, task: str) -> None:
        self._suite = suite
        self._task = task
        self._steps = suite.max_steps(task)
        self._ee: tuple[Any, Any] | None = None  # (physics, gym-aloha end-effector task), made on first plan
        self._planned_for = b""
        self._commands = np.zeros((0, suite.action_dim))

    def __call__(self, obs: SimObservation) -> np.ndarray:
        if "initial_object_pose" not in obs or "step" not in obs:
            raise SuiteError(f"{self._suite.name}/{self._task}: the expert replays a plan made from the initial "
                             "object pose and needs the step index; pass it env.expert_observation(), not the "
                             "policy's observation")
        pose = np.asarray(obs["initial_object_pose"], dtype=np.float64)
        if pose.tobytes() != self._planned_for:
            self._commands = self.joint_commands(pose)
            self._planned_for = pose.tobytes()
        step = int(obs["step"])
        if not 0 <= step < len(self._commands):
            raise SuiteError(f"{self._suite.name}/{self._task}: the scripted expert has commands for steps 0 to "
                             f"{len(self._commands) - 1}, not step {step}")
        return np.clip(self._commands[step].astype(np.float32), self._suite.action_low_array,
                       self._suite.action_high_array)

    def joint_commands(self, initial_object_pose: np.ndarray) -> np.ndarray:
        """``float64[max_steps, 14]``: the joint command of each step for these initial object poses."""
        from gym_aloha.constants import normalize_puppet_gripper_position

        physics, ee_task = self._end_effector_sim()
        # gym-aloha's end-effector initialize_episode, with our pose instead of one from NumPy's global RNG.
        with physics.reset_context():
            ee_task.initialize_robots(physics)
            physics.data.qpos[_ARM_QPOS:] = initial_object_pose
        left = np.concatenate([physics.data.mocap_pos[0], physics.data.mocap_quat[0]])
        right = np.concatenate([physics.data.mocap_pos[1], physics.data.mocap_quat[1]])
        left_path, right_path = _WAYPOINTS[self._task](initial_object_pose, left, right)
        substeps = _substeps(physics)

        def joint_command() -> np.ndarray:
            # The arms' measured joints; the grippers' *commanded* openings (their ctrl), as ACT records them.
            command = ee_task.get_qpos(physics)
            command[6] = normalize_puppet_gripper_position(physics.data.ctrl[0])
            command[13] = normalize_puppet_gripper_position(physics.data.ctrl[2])
            return command

        commands = [joint_command()]
        for step in range(self._steps - 1):
            ee_task.before_step(np.concatenate([_interpolate(left_path, step), _interpolate(right_path, step)]),
                                physics)
            physics.step(substeps)
            commands.append(joint_command())
        return np.stack(commands)

    def _end_effector_sim(self) -> tuple[Any, Any]:
        if self._ee is None:
            physics = _load_physics(_MODELS[self._task][1])  # first: it imports dm_control safely
            from gym_aloha.tasks.sim_end_effector import (
                InsertionEndEffectorTask,
                TransferCubeEndEffectorTask,
            )

            _restore_mujoco2_mocap_welds(physics)
            task = TransferCubeEndEffectorTask() if self._task == TRANSFER_CUBE else InsertionEndEffectorTask()
            self._ee = (physics, task)
        return self._ee


def _make_env(suite: Suite, task: str, seed: int) -> EpisodeEnv:
    return AlohaEnv(suite, task, seed)


def _make_expert(suite: Suite, task: str) -> ExpertPolicy:
    return ScriptedAlohaExpert(suite, task)


def _suite(name: str, task: str, description: str) -> Suite:
    return Suite(
        name=name,
        simulator="aloha",
        description=description,
        tasks=(TaskSpec(task, INSTRUCTIONS[task], MAX_STEPS),),
        state_dim=len(STATE_NAMES),
        action_dim=len(ACTION_NAMES),
        action_low=ACTION_LOW,
        action_high=ACTION_HIGH,
        fps=FPS,
        env_factory=_make_env,
        expert_factory=_make_expert,
        state_names=STATE_NAMES,
        action_names=ACTION_NAMES,
        cameras=CAMERAS,
        overview_camera=OVERVIEW_CAMERA,
        seed_rule=SEED_RULE,
    )


def suites() -> list[Suite]:
    """The two ALOHA suites, one task each."""
    return [
        _suite("aloha-transfer-cube", TRANSFER_CUBE, "ALOHA (gym-aloha): two ViperX arms; the right arm picks up a "
               "cube and hands it to the left arm (14 joint positions; a top camera)"),
        _suite("aloha-insertion", INSERTION, "ALOHA (gym-aloha): two ViperX arms pick up a peg and a socket and "
               "insert the peg in mid-air (14 joint positions; a top camera)"),
    ]
