"""What a benchmark suite is: its tasks, dimensions, seeds, success rule and episode interface.

A simulator module (``benchmarks/metaworld.py``, ``benchmarks/pusht.py``) declares
its suites as ``Suite`` values and implements ``EpisodeEnv`` once. Everything a
caller needs goes through a ``Suite``:

- static facts, readable without importing any simulator: task names, per-task
  instruction and step limit, state/action dimensions and names, action bounds,
  control rate (``fps``);
- ``suite.make_env(task, seed)`` → an ``EpisodeEnv`` whose ``reset()`` puts the
  simulator in the initial state that ``seed`` names — the same state on every call
  and every machine with the same simulator build;
- ``suite.expert(task)`` → a scripted policy, ``obs -> action``, or
  ``NoExpertError`` when the simulator has none. Feed it
  ``env.expert_observation()``, not the policy's observation: a pixel suite hides
  part of the state (the goal) from the policy but not from its expert;
- ``suite.cameras``: the cameras the suite can render (``CameraSpec``: name and
  default height × width), ``suite.overview_camera`` the one replays show, and
  ``suite.resolve_cameras(...)`` turns a request (names, or ``{name: [h, w]}``)
  into the checked ``{name: (height, width)}`` that ``env.render_images`` takes.

Observations are canonical (the wire protocol's ``SimObservation``):
``{"state": float32[state_dim], "task": task_name}`` plus, optionally,
``"images": {camera: uint8[H, W, 3]}``. ``reset`` and ``step`` never render:
images cost far more than a physics step, so a caller renders with
``env.render_images(cameras)`` exactly when (and what) its policy will look at,
and a state-only evaluation renders nothing. Frames show the simulator's current
state, upright (row 0 is the top of the picture), as C-contiguous ``uint8[h, w, 3]``;
the same seed and the same actions give byte-identical frames.

An episode ends when the task's success criterion holds (``success=True``,
``done=True``) or after ``max_steps`` steps (``done=True``, ``success=False``),
the way MetaWorld's own evaluation terminates on success.

Seeds: ``DEMO_SEEDS`` are for collecting training demonstrations and
``EVAL_SEED_START`` upward for evaluation, so a policy is never evaluated on an
initial state it was trained on. ``evaluation_seed(i)`` gives the i-th one. Each
simulator module says in one string (``Suite.seed_rule``) how a seed becomes an
initial state.

Versions: ``suite.definition_hash()`` is the SHA-256 of the canonical JSON of the facts
that decide what a result means — name, simulator, tasks (instruction, step limit),
state/action dimensions and names, action bounds, ``fps``, cameras and sizes, the seed
rule — and nothing else (descriptions are prose). Evaluations record it, and the
leaderboard ranks one hash at a time: changing any of those facts gives the suite a new
leaderboard version, and the older results stay readable under their own hash.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SimObservation = dict[str, Any]
"""``{"state": float32[D], "task": str}`` and optionally ``"images"``."""

ExpertPolicy = Callable[[SimObservation], np.ndarray]
"""A scripted policy: canonical observation in, float32 action of ``action_dim`` out."""

# Demonstrations use seeds below EVAL_SEED_START; evaluations use seeds from it upward.
# A million demo seeds per task is more than any collection here will use, and keeping
# the split a constant (not a flag) is what makes "never evaluated on a training seed" hold
# across tools written by different people.
EVAL_SEED_START = 1_000_000
DEMO_SEEDS = range(0, EVAL_SEED_START)


def evaluation_seed(episode_index: int) -> int:
    """The seed of the ``episode_index``-th evaluation episode of a task (disjoint from demo seeds)."""
    if episode_index < 0:
        raise ValueError(f"evaluation episode index must be >= 0, got {episode_index}")
    return EVAL_SEED_START + episode_index


class SuiteError(ValueError):
    """A suite or task name that does not exist, or a request a suite cannot serve."""


class NoExpertError(SuiteError):
    """The suite has no scripted expert for the task."""


MIN_IMAGE_SIDE = 16
MAX_IMAGE_SIDE = 1024
"""Bounds on a rendered image's height and width, in pixels. Below 16 a picture shows
nothing a policy can use; above 1024 one frame of one camera costs seconds in a
software renderer and megabytes on the wire at every step."""


@dataclass(frozen=True)
class CameraSpec:
    """A camera a suite can render, with its default image size."""

    name: str
    height: int
    width: int
    description: str = ""


def close_matches(name: str, candidates: Sequence[str], n: int = 5) -> str:
    """``"; did you mean: a, b?"`` for the candidates closest to ``name``, or ``""``."""
    matches = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)
    return f"; did you mean: {', '.join(matches)}?" if matches else ""


@dataclass(frozen=True)
class TaskSpec:
    """One task of a suite."""

    name: str
    instruction: str
    max_steps: int


@dataclass(frozen=True)
class StepResult:
    """What ``EpisodeEnv.step`` returns."""

    obs: SimObservation
    reward: float
    success: bool
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def canonical_observation(state: np.ndarray, task: str,
                          images: Mapping[str, np.ndarray] | None = None) -> SimObservation:
    """The canonical observation dict: contiguous float32 state, task name, optional images."""
    obs: SimObservation = {"state": np.ascontiguousarray(state, dtype=np.float32), "task": task}
    if images:
        obs["images"] = dict(images)
    return obs


class EpisodeEnv(ABC):
    """One task of one suite, reset to the initial state a seed names.

    ``reset(seed)`` may rebind the environment to another seed, so one simulator
    instance (whose construction is the slow part) serves many episodes.
    """

    def __init__(self, suite: Suite, task: str, seed: int) -> None:
        self.suite = suite
        self.task = suite.task(task).name
        self.max_steps = suite.max_steps(task)
        self.seed = _check_seed(seed)
        self.steps = 0
        self._done = True
        self._last_obs: SimObservation | None = None

    def reset(self, seed: int | None = None) -> SimObservation:
        """Start an episode from ``seed``'s initial state (default: the seed this env was made with)."""
        if seed is not None:
            self.seed = _check_seed(seed)
        self.steps = 0
        self._done = False
        self._last_obs = self._reset(self.seed)
        return self._last_obs

    def step(self, action: np.ndarray | Sequence[float]) -> StepResult:
        """Apply one action. Actions are clipped to the suite's bounds; NaN is refused."""
        if self._done:
            raise RuntimeError(f"{self.suite.name}/{self.task}: the episode is over (or was never "
                               "started); call reset() before step()")
        act = np.asarray(action, dtype=np.float32).reshape(-1)
        if act.shape != (self.suite.action_dim,):
            raise ValueError(f"{self.suite.name}/{self.task}: action must have {self.suite.action_dim} "
                             f"values, got shape {list(np.shape(action))}")
        if not np.isfinite(act).all():
            raise ValueError(f"{self.suite.name}/{self.task}: action contains NaN or infinity: {act.tolist()}")
        # Clip here rather than trusting each simulator to: the action that was applied
        # is the one recorded in demos, so it must lie inside the published bounds.
        act = np.clip(act, self.suite.action_low_array, self.suite.action_high_array)
        obs, reward, success, info = self._step(act)
        self._last_obs = obs
        self.steps += 1
        truncated = not success and self.steps >= self.max_steps
        self._done = success or truncated
        info = {**info, "action": act, "truncated": truncated}
        return StepResult(obs=obs, reward=float(reward), success=bool(success), done=self._done, info=info)

    def expert_observation(self) -> SimObservation:
        """What the suite's scripted expert needs now: the last observation ``reset``/``step``
        returned, unless the suite hides part of the state from the policy (a pixel
        suite's goal), in which case the simulator module returns the full state."""
        if self._last_obs is None:
            raise RuntimeError(f"{self.suite.name}/{self.task}: no episode has started; call reset() first")
        return self._last_obs

    def hidden_state(self) -> tuple[tuple[str, ...], np.ndarray] | None:
        """What the suite hides from the policy's state now (a pixel suite's goal): its names and
        float32 values, or None when the policy sees the whole state. Demonstrations record it as
        LeRobot's ``observation.environment_state`` (privileged information a training run may use
        as an auxiliary target; a policy is never given it)."""
        return None

    def render_images(self, cameras: Mapping[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        """The current simulator state from each camera: ``{name: uint8[height, width, 3]}``.

        ``cameras`` maps camera names to ``(height, width)``, as ``Suite.resolve_cameras``
        returns them. Frames are upright and C-contiguous; an unknown camera or a size
        outside [MIN_IMAGE_SIDE, MAX_IMAGE_SIDE] raises ``SuiteError``.
        """
        if not self.suite.cameras:
            raise SuiteError(f"suite {self.suite.name} renders no cameras; evaluate it with a state-only "
                             "policy (one whose card declares no cameras)")
        for name, size in cameras.items():
            self.suite.camera(name)
            _check_image_size(name, size)
        return {name: self._render_camera(name, int(size[0]), int(size[1])) for name, size in cameras.items()}

    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        """One upright, C-contiguous ``uint8[height, width, 3]`` frame of a checked camera and size."""
        raise SuiteError(f"suite {self.suite.name} declares camera {camera!r} but its environment "
                         f"{type(self).__name__} cannot render it")

    @abstractmethod
    def close(self) -> None:
        """Release the simulator (and any renderer)."""

    def __enter__(self) -> EpisodeEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _reset(self, seed: int) -> SimObservation:
        """Put the simulator in ``seed``'s initial state; return the canonical observation."""

    @abstractmethod
    def _step(self, action: np.ndarray) -> tuple[SimObservation, float, bool, dict[str, Any]]:
        """Apply a clipped float32 action; return (obs, reward, success, info)."""


def _check_image_size(camera: str, size: object) -> tuple[int, int]:
    """``size`` as ``(height, width)`` when it is two integers in [MIN_IMAGE_SIDE, MAX_IMAGE_SIDE]."""
    if (not isinstance(size, Sequence) or isinstance(size, str) or len(size) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in size)):
        raise SuiteError(f"camera {camera!r}: the size must be [height, width] (two integers), got {size!r}")
    height, width = int(size[0]), int(size[1])
    if not (MIN_IMAGE_SIDE <= height <= MAX_IMAGE_SIDE and MIN_IMAGE_SIDE <= width <= MAX_IMAGE_SIDE):
        raise SuiteError(f"camera {camera!r}: size {height}×{width} is outside the limit: height and width "
                         f"must each be between {MIN_IMAGE_SIDE} and {MAX_IMAGE_SIDE} pixels")
    return height, width


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"episode seed must be a non-negative integer, got {seed!r}")
    return int(seed)


EnvFactory = Callable[["Suite", str, int], EpisodeEnv]
ExpertFactory = Callable[["Suite", str], ExpertPolicy]


@dataclass(frozen=True)
class Suite:
    """A named set of tasks on one simulator with one observation and action space.

    ``env_factory`` and ``expert_factory`` are functions of the simulator module that
    import the simulator only when called, so reading a suite's facts stays cheap.
    """

    name: str
    simulator: str
    description: str
    tasks: tuple[TaskSpec, ...]
    state_dim: int
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    fps: float
    env_factory: EnvFactory = field(repr=False, compare=False)
    expert_factory: ExpertFactory | None = field(default=None, repr=False, compare=False)
    no_expert_reason: str = ""
    state_names: tuple[str, ...] = ()
    action_names: tuple[str, ...] = ()
    cameras: tuple[CameraSpec, ...] = ()
    overview_camera: str | None = None
    # How a seed becomes an initial state, in words (e.g. "numpy default_rng([crc32(task), seed])
    # draws the object and goal positions"); every simulator module declares one, and changing it
    # changes the definition hash.
    seed_rule: str = ""
    # How the simulator draws the scene where that differs from its stock rendering (e.g. a pixel
    # suite's enlarged goal marker): part of the definition hash when set, so frames drawn another
    # way are another version of the suite.
    rendering: str = ""
    # False for plumbing suites (``null``): their evaluations are never standard and the
    # leaderboard never ranks them. Not part of the definition hash (it says nothing about results).
    leaderboard: bool = True

    def __post_init__(self) -> None:
        names = [t.name for t in self.tasks]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"suite {self.name}: tasks must be distinct and non-empty, got {names}")
        if len(self.action_low) != self.action_dim or len(self.action_high) != self.action_dim:
            raise ValueError(f"suite {self.name}: action bounds must have {self.action_dim} values")
        for what, names_, dim in (("state", self.state_names, self.state_dim),
                                  ("action", self.action_names, self.action_dim)):
            if names_ and len(names_) != dim:
                raise ValueError(f"suite {self.name}: {len(names_)} {what} names for {dim} dimensions")
        cameras = [c.name for c in self.cameras]
        if len(set(cameras)) != len(cameras):
            raise ValueError(f"suite {self.name}: camera names must be distinct, got {cameras}")
        for camera in self.cameras:
            _check_image_size(camera.name, (camera.height, camera.width))
        if self.overview_camera is not None and self.overview_camera not in cameras:
            raise ValueError(f"suite {self.name}: overview camera {self.overview_camera!r} is not one of its "
                             f"cameras {cameras}")

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    @property
    def has_expert(self) -> bool:
        return self.expert_factory is not None

    @property
    def action_low_array(self) -> np.ndarray:
        return np.asarray(self.action_low, dtype=np.float32)

    @property
    def action_high_array(self) -> np.ndarray:
        return np.asarray(self.action_high, dtype=np.float32)

    def task(self, name: str) -> TaskSpec:
        """The task called ``name``; the error lists close matches."""
        for spec in self.tasks:
            if spec.name == name:
                return spec
        listing = f" (its tasks: {', '.join(self.task_names)})" if len(self.tasks) <= 10 else ""
        raise SuiteError(f"suite {self.name} has no task {name!r}{close_matches(name, self.task_names)}"
                         f"{listing}")

    def instruction(self, task: str) -> str:
        return self.task(task).instruction

    def max_steps(self, task: str) -> int:
        return self.task(task).max_steps

    def make_env(self, task: str, seed: int = 0) -> EpisodeEnv:
        """An environment for ``task`` bound to ``seed``; call ``reset()`` to start the episode."""
        self.task(task)  # fail on a bad name before building a simulator
        return self.env_factory(self, task, seed)

    def expert(self, task: str) -> ExpertPolicy:
        """The scripted expert for ``task``, or ``NoExpertError`` saying why there is none."""
        self.task(task)
        if self.expert_factory is None:
            raise NoExpertError(f"suite {self.name} has no scripted expert: {self.no_expert_reason}")
        return self.expert_factory(self, task)

    @property
    def camera_names(self) -> list[str]:
        return [c.name for c in self.cameras]

    def camera(self, name: str) -> CameraSpec:
        """The camera called ``name``; the error lists the suite's cameras."""
        for spec in self.cameras:
            if spec.name == name:
                return spec
        available = ", ".join(self.camera_names) or "none: it is state-only"
        raise SuiteError(f"suite {self.name} has no camera {name!r}{close_matches(name, self.camera_names)} "
                         f"(its cameras: {available})")

    def resolve_cameras(self, names_or_sizes: Mapping[str, Sequence[int]] | Sequence[str] | None
                        ) -> dict[str, tuple[int, int]]:
        """A camera request as the checked ``{name: (height, width)}`` that ``render_images`` takes.

        ``{"corner": [96, 96]}`` gives each camera its size; ``["corner", "gripper"]``
        uses the suite's default sizes; ``None``, ``{}`` or ``[]`` means no images.
        Unknown names and sizes outside [MIN_IMAGE_SIDE, MAX_IMAGE_SIDE] raise ``SuiteError``.
        """
        if not names_or_sizes:
            return {}
        if isinstance(names_or_sizes, Mapping):
            resolved = {}
            for name, size in names_or_sizes.items():
                self.camera(name)
                resolved[name] = _check_image_size(name, size)
            return resolved
        if isinstance(names_or_sizes, str) or not isinstance(names_or_sizes, Sequence):
            raise SuiteError(f"suite {self.name}: cameras must be a list of names or a {{name: [height, width]}} "
                             f"mapping, got {type(names_or_sizes).__name__} {names_or_sizes!r}")
        if len(set(names_or_sizes)) != len(names_or_sizes):
            raise SuiteError(f"suite {self.name}: camera names repeat in {list(names_or_sizes)}")
        return {name: (spec.height, spec.width) for name in names_or_sizes for spec in [self.camera(name)]}

    def _definition(self) -> dict[str, Any]:
        """The facts that decide what a result on this suite means, as ``definition_hash`` hashes them."""
        return {
            "name": self.name,
            "simulator": self.simulator,
            "tasks": [{"name": t.name, "instruction": t.instruction, "max_steps": t.max_steps} for t in self.tasks],
            "state_dim": self.state_dim,
            "state_names": list(self.state_names),
            "action_dim": self.action_dim,
            "action_names": list(self.action_names),
            "action_low": [float(v) for v in self.action_low],
            "action_high": [float(v) for v in self.action_high],
            "fps": float(self.fps),
            "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in self.cameras],
            "seed_rule": self.seed_rule,
            # Only when set: the suites that draw their scene as stock keep the hash they had.
            **({"rendering": self.rendering} if self.rendering else {}),
        }

    def definition_hash(self) -> str:
        """SHA-256 (hex) of ``_definition()`` as canonical JSON: sorted keys, no spaces, ASCII.

        The same on every machine and in every process (floats print as their shortest
        round-trip repr); a change to any fact it covers is a new version of the suite.
        """
        canonical = json.dumps(self._definition(), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                               allow_nan=False)
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    def catalogue_entry(self) -> dict[str, Any]:
        """JSON-ready facts about the suite (no simulator needed)."""
        return {
            "name": self.name,
            "simulator": self.simulator,
            "description": self.description,
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "action_low": list(self.action_low),
            "action_high": list(self.action_high),
            "fps": self.fps,
            "has_expert": self.has_expert,
            "tasks": [{"name": t.name, "instruction": t.instruction, "max_steps": t.max_steps}
                      for t in self.tasks],
            "state_names": list(self.state_names),
            "action_names": list(self.action_names),
            "cameras": [{"name": c.name, "height": c.height, "width": c.width, "description": c.description}
                        for c in self.cameras],
            "overview_camera": self.overview_camera,
            **({"rendering": self.rendering} if self.rendering else {}),
        }
