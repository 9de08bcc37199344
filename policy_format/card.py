"""``policy.json``: what a checkpoint's card says about its policy — read, validated, written.

The trainer writes the card next to a checkpoint's weights; the policy server reads it
to turn observations into prompts and generated tokens into actions. Both use this
module, so the rules below are checked by one piece of code. Format version 3::

    {
      "format": "evalforge.policy", "format_version": 3,
      "name": "reach-bc", "suite": "metaworld-mt1-reach",
      "state_dim": 39, "action_dim": 4, "chunk_size": 4,
      "state_bins": 256, "action_bins": 256,
      "state_bounds":  {"low": [...state_dim], "high": [...state_dim]},
      "action_bounds": {"low": [...action_dim], "high": [...action_dim]},
      "token_ranges": {"state": [0, 256], "action": [256, 512], "task": [512, 513]},
      "tasks": [{"name": "reach-v3", "token_id": 512, "instruction": "Reach the goal."}],
      "cameras": [{"name": "corner", "height": 64, "width": 64, "resize": "bilinear", "scale": "signed"}],
      "vision": {"image_size": 64, "patch_size": 8, "hidden_size": 128, "intermediate_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "layer_norm_eps": 1e-06,
                 "hidden_act": "gelu_pytorch_tanh", "projector_act": "gelu", "feature_layer": -1,
                 "weights": "vision.safetensors"},
      "provenance": {"dataset": "...", "steps": 2000, "source_commit": "..."}
    }

Token ranges are half-open ``[start, end)``, must not overlap, and the state and action
ranges hold exactly ``*_bins`` ids; each task's ``token_id`` lies in the task range.
Bounds are finite with ``high > low`` in every dimension. How tokens are laid out and
binned is :mod:`policy_format.tokens`.

``cameras`` (optional; written only when there are any) lists the images the policy
takes, in the order it takes them: a name matching ``[A-Za-z0-9_.-]{1,64}``, distinct, at
most 16; ``height`` and ``width`` from 1 to 4096; ``resize`` ``bilinear`` or ``nearest``;
``scale`` ``unit`` or ``signed`` (see :mod:`policy_format.images`). A card without cameras is a
state-only policy.

``vision`` (optional; needs cameras, all square at the encoder's ``image_size``) makes a
vision policy: the encoder and projector of :class:`~policy_format.images.VisionEncoder`,
whose weights are the checkpoint's ``weights`` file. Its prompt is ``[task, image rows of
each camera in card order, state tokens]`` (:class:`~policy_format.tokens.PolicyTokenizer`'s
``image_len`` rows). A card with cameras and no ``vision`` has its images validated on the
serving path and a state-only model.

**Versions.** ``format_version`` names the layout of the file. :data:`READERS` maps every
version this code reads to its reader; a reader turns its version into the current
:class:`PolicyCard`, and :meth:`PolicyCard.write` always writes :data:`FORMAT_VERSION`.
A new version adds a reader and keeps the old ones (``tests/policy_format`` loads a file
of every version).

- version 1: everything above but ``cameras``;
- version 2: adds the optional ``cameras``. A version-1 file reads as a card without cameras;
- version 3: adds the optional ``vision`` and the ``signed`` scale. A version-2 file reads as
  a card without a vision encoder.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_format.images import (
    CAMERA_NAME_PATTERN,
    MAX_CAMERAS,
    MAX_IMAGE_SIDE,
    RESIZE_METHODS,
    SCALES,
    CameraInput,
    VisionEncoder,
)
from policy_format.tokens import ActionTokenizer, PolicyTokenizer, StateTokenizer, TokenLayout

FORMAT = "evalforge.policy"
FORMAT_VERSION = 3
FILENAME = "policy.json"


class PolicyFormatError(ValueError):
    """A policy.json that breaks the format; the message names the file, the field and the problem."""


@dataclass(eq=False)
class PolicyCard:
    """Everything policy.json records about a policy.

    The trainer builds one with the fields below (``layout`` and ``task_ids`` then follow
    the packed layout: state bins, action bins, one token per task in ``tasks`` order);
    :meth:`read` gives the one a file holds. Bounds are array-likes of ``*_dim`` floats;
    ``cameras`` (any sequence, kept as a tuple) are the images the policy takes, in order.
    """

    name: str
    state_dim: int
    action_dim: int
    chunk_size: int
    tasks: Sequence[str]
    state_low: Sequence[float]
    state_high: Sequence[float]
    action_low: Sequence[float]
    action_high: Sequence[float]
    instructions: dict[str, str] = field(default_factory=dict)
    suite: str | None = None
    state_bins: int = 256
    action_bins: int = 256
    provenance: dict[str, Any] = field(default_factory=dict)
    layout: TokenLayout = None  # type: ignore[assignment]  # None: TokenLayout.packed(bins, bins, len(tasks))
    task_ids: dict[str, int] = None  # type: ignore[assignment]  # None: the task range's ids in tasks order
    cameras: tuple[CameraInput, ...] = ()
    vision: VisionEncoder | None = None

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        if self.layout is None:
            self.layout = TokenLayout.packed(self.state_bins, self.action_bins, len(self.tasks))
        if self.task_ids is None:
            self.task_ids = {name: self.layout.task_range[0] + i for i, name in enumerate(self.tasks)}

    @property
    def image_len(self) -> int:
        """Image rows in the prompt: ``tokens_per_image`` per camera for a vision policy, else 0."""
        return self.vision.tokens_per_image * len(self.cameras) if self.vision is not None else 0

    @property
    def camera_sizes(self) -> dict[str, tuple[int, int]]:
        """Camera name → (height, width), in the card's order; {} for a state-only policy."""
        return {camera.name: camera.size for camera in self.cameras}

    # --- reading ---------------------------------------------------------------------

    @classmethod
    def read(cls, path: str | Path, *, vocab_size: int | None = None) -> PolicyCard:
        """The card in ``path`` (a policy.json, or a directory holding one), validated (see :meth:`from_json`)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        try:
            text = path.read_text()
        except OSError as exc:
            raise PolicyFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyFormatError(f"{path}: invalid JSON: {exc}") from None
        return cls.from_json(raw, source=str(path), vocab_size=vocab_size)

    @classmethod
    def from_json(cls, raw: Any, *, source: str = FILENAME, vocab_size: int | None = None) -> PolicyCard:
        """The card a decoded policy.json holds, of any version in :data:`READERS`.

        With ``vocab_size`` (the model's), token ranges beyond it are refused too. Raises
        :class:`PolicyFormatError` naming ``source`` and the first problem found.
        """
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise PolicyFormatError(f"{source}: policy.json must have \"format\": \"{FORMAT}\"")
        version = raw.get("format_version")
        reader = READERS.get(version) if type(version) is int else None
        if reader is None:
            readable = ", ".join(map(str, sorted(READERS)))
            raise PolicyFormatError(f"{source}: policy.json format_version {version!r} is not supported; this "
                                    f"EvalForge reads version {readable} (a newer EvalForge wrote it? upgrade "
                                    "this one)")
        try:
            return reader(raw, vocab_size)
        except _Invalid as exc:
            raise PolicyFormatError(f"{source}: {exc}") from None

    # --- checking and writing ---------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`PolicyFormatError` unless a reader would accept what :meth:`write` writes."""
        PolicyCard.from_json(self._json({}), source=f"policy card {self.name!r}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise :class:`PolicyFormatError` unless every token range fits a model vocabulary of ``vocab_size``."""
        problem = _vocabulary_problem(self.layout, vocab_size)
        if problem:
            raise PolicyFormatError(problem)

    def to_json(self) -> dict[str, Any]:
        """The policy.json document (current version); provenance gains the source commit unless it has one."""
        return self._json({"source_commit": source_commit()})

    def write(self, directory: str | Path) -> Path:
        """Validate and write ``directory/policy.json``; returns its path."""
        self.validate()
        path = Path(directory) / FILENAME
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def _json(self, provenance_defaults: dict[str, Any]) -> dict[str, Any]:
        layout = self.layout
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "suite": self.suite,
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "chunk_size": self.chunk_size,
            "state_bins": self.state_bins,
            "action_bins": self.action_bins,
            "state_bounds": {"low": _floats(self.state_low), "high": _floats(self.state_high)},
            "action_bounds": {"low": _floats(self.action_low), "high": _floats(self.action_high)},
            "token_ranges": {name: list(bounds) for name, bounds in layout.ranges.items()},
            "tasks": [{"name": name, "token_id": self.task_ids.get(name), "instruction": self.instructions.get(name, "")}
                      for name in self.tasks],
            **({"cameras": [{"name": c.name, "height": c.height, "width": c.width, "resize": c.resize,
                             "scale": c.scale} for c in self.cameras]} if self.cameras else {}),
            **({"vision": self.vision.to_json()} if self.vision is not None else {}),
            "provenance": {**provenance_defaults, **self.provenance},
        }

    # --- using ------------------------------------------------------------------------

    def tokenizer(self) -> PolicyTokenizer:
        """The tokenizer of this policy (validated first): the one the trainer trains with and the server prompts with."""
        self.validate()
        return PolicyTokenizer(
            {name: self.task_ids[name] for name in self.tasks},
            StateTokenizer(self.state_low, self.state_high, self.state_bins, self.layout.state_range[0]),
            ActionTokenizer(self.action_low, self.action_high, self.action_bins, self.layout.action_range[0]),
            self.chunk_size, self.layout, image_len=self.image_len)


def _floats(values: Sequence[float] | np.ndarray) -> list[float]:
    return [float(v) for v in values]


def source_commit() -> str | None:
    """The git commit of the code that made the checkpoint, if there is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# --- version 1 ---------------------------------------------------------------------------


class _Invalid(Exception):
    """A reader's complaint; :meth:`PolicyCard.from_json` prefixes the source."""


def _vocabulary_problem(layout: TokenLayout, vocab_size: int) -> str | None:
    for name, (_, end) in layout.ranges.items():
        if end > vocab_size:
            return (f"token_ranges.{name} ends at {end} but the model's vocabulary has only {vocab_size} ids; "
                    f"the model needs a vocab_size of at least {layout.end}")
    return None


def _int(raw: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    value = raw.get(key)
    if type(value) is not int or value < minimum:
        raise _Invalid(f"policy.json field '{key}' must be an integer ≥ {minimum}, got {value!r}")
    return value


def _bounds(raw: Mapping[str, Any], key: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    bounds = raw.get(key)
    if not isinstance(bounds, dict) or "low" not in bounds or "high" not in bounds:
        raise _Invalid(f"policy.json field '{key}' must be {{\"low\": [...], \"high\": [...]}}")
    try:
        low = np.asarray(bounds["low"], dtype=np.float64)
        high = np.asarray(bounds["high"], dtype=np.float64)
    except (TypeError, ValueError):
        raise _Invalid(f"policy.json '{key}' must hold lists of numbers") from None
    if low.shape != (dim,) or high.shape != (dim,):
        raise _Invalid(f"policy.json '{key}' must have {dim} lows and highs, got {low.shape} and {high.shape}")
    if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high <= low).any():
        raise _Invalid(f"policy.json '{key}' must be finite with high > low in every dimension")
    low.flags.writeable = high.flags.writeable = False
    return low, high


def _range(ranges: Mapping[str, Any], key: str) -> tuple[int, int]:
    value = ranges.get(key)
    if (not isinstance(value, list) or len(value) != 2 or not all(type(v) is int for v in value)
            or not 0 <= value[0] < value[1]):
        raise _Invalid(f"policy.json token_ranges.{key} must be [start, end) with 0 ≤ start < end, got {value!r}")
    return value[0], value[1]


def _read_v1(raw: dict[str, Any], vocab_size: int | None) -> PolicyCard:
    state_dim = _int(raw, "state_dim")
    action_dim = _int(raw, "action_dim")
    chunk_size = _int(raw, "chunk_size")
    state_bins = _int(raw, "state_bins", minimum=2)
    action_bins = _int(raw, "action_bins", minimum=2)
    state_low, state_high = _bounds(raw, "state_bounds", state_dim)
    action_low, action_high = _bounds(raw, "action_bounds", action_dim)

    ranges = raw.get("token_ranges")
    if not isinstance(ranges, dict):
        raise _Invalid("policy.json needs token_ranges with state, action and task")
    layout = TokenLayout(_range(ranges, "state"), _range(ranges, "action"), _range(ranges, "task"))
    if layout.state_bins != state_bins:
        raise _Invalid(f"token_ranges.state holds {layout.state_bins} ids but state_bins is {state_bins}")
    if layout.action_bins != action_bins:
        raise _Invalid(f"token_ranges.action holds {layout.action_bins} ids but action_bins is {action_bins}")
    overlap = layout.overlap()
    if overlap is not None:
        a, b = overlap
        raise _Invalid(f"token_ranges.{a} {list(layout.ranges[a])} overlaps token_ranges.{b} {list(layout.ranges[b])}")
    problem = _vocabulary_problem(layout, vocab_size) if vocab_size is not None else None
    if problem:
        raise _Invalid(problem)

    task_ids: dict[str, int] = {}
    instructions: dict[str, str] = {}
    entries = raw.get("tasks") or []
    if not isinstance(entries, list):
        raise _Invalid(f"policy.json field 'tasks' must be a list of task entries, got {entries!r}")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or type(entry.get("token_id")) is not int:
            raise _Invalid(f"policy.json task entry {entry!r} needs a string name and an integer token_id")
        name, token_id = entry["name"], entry["token_id"]
        if not layout.task_range[0] <= token_id < layout.task_range[1]:
            raise _Invalid(f"task {name!r} has token_id {token_id} outside token_ranges.task {list(layout.task_range)}")
        if name in task_ids or token_id in task_ids.values():
            raise _Invalid(f"task {name!r} or its token_id {token_id} appears twice")
        task_ids[name] = token_id
        instructions[name] = str(entry.get("instruction", ""))
    if not task_ids:
        raise _Invalid("policy.json lists no tasks")
    provenance = raw.get("provenance") or {}
    if not isinstance(provenance, dict):
        raise _Invalid(f"policy.json field 'provenance' must be an object, got {provenance!r}")

    return PolicyCard(
        name=str(raw.get("name") or ""), suite=raw.get("suite"),
        state_dim=state_dim, action_dim=action_dim, chunk_size=chunk_size,
        tasks=tuple(task_ids), instructions=instructions,
        state_low=state_low, state_high=state_high, action_low=action_low, action_high=action_high,
        state_bins=state_bins, action_bins=action_bins, provenance=provenance,
        layout=layout, task_ids=task_ids,
    )


# --- version 2 ---------------------------------------------------------------------------


def _cameras(raw: Mapping[str, Any]) -> tuple[CameraInput, ...]:
    entries = raw.get("cameras", [])
    if not isinstance(entries, list):
        raise _Invalid(f"policy.json field 'cameras' must be a list of camera entries, got {type(entries).__name__}")
    if len(entries) > MAX_CAMERAS:
        raise _Invalid(f"policy.json lists {len(entries)} cameras; a policy takes at most {MAX_CAMERAS}")
    cameras: list[CameraInput] = []
    for index, entry in enumerate(entries):
        where = f"policy.json cameras[{index}]"
        if not isinstance(entry, dict):
            raise _Invalid(f"{where} must be an object with name, height, width, resize and scale")
        name = entry.get("name")
        if not isinstance(name, str) or not CAMERA_NAME_PATTERN.fullmatch(name):
            raise _Invalid(f"{where} name {name!r} must match {CAMERA_NAME_PATTERN.pattern}")
        if name in (camera.name for camera in cameras):
            raise _Invalid(f"{where}: camera {name!r} appears twice")
        sides = [entry.get("height"), entry.get("width")]
        if not all(type(side) is int and 1 <= side <= MAX_IMAGE_SIDE for side in sides):
            raise _Invalid(f"{where} (camera {name!r}) height and width must be integers from 1 to "
                           f"{MAX_IMAGE_SIDE}, got {sides}")
        resize = entry.get("resize", RESIZE_METHODS[0])
        if resize not in RESIZE_METHODS:
            raise _Invalid(f"{where} (camera {name!r}) resize {resize!r} is not one of {', '.join(RESIZE_METHODS)}")
        scale = entry.get("scale", SCALES[0])
        if scale not in SCALES:
            raise _Invalid(f"{where} (camera {name!r}) scale {scale!r} is not one of {', '.join(SCALES)}")
        cameras.append(CameraInput(name=name, height=sides[0], width=sides[1], resize=resize, scale=scale))
    return tuple(cameras)


def _read_v2(raw: dict[str, Any], vocab_size: int | None) -> PolicyCard:
    """Version 1's fields, plus the optional ``cameras``."""
    card = _read_v1(raw, vocab_size)
    card.cameras = _cameras(raw)
    return card


# --- version 3 ---------------------------------------------------------------------------


def _vision(raw: Mapping[str, Any], cameras: tuple[CameraInput, ...]) -> VisionEncoder | None:
    entry = raw.get("vision")
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise _Invalid(f"policy.json field 'vision' must be an object, got {type(entry).__name__}")
    known = set(VisionEncoder.__dataclass_fields__)
    unknown = sorted(set(entry) - known)
    if unknown:
        raise _Invalid(f"policy.json vision has unknown fields {unknown}; it takes {sorted(known)}")
    try:
        vision = VisionEncoder(**entry)
    except TypeError as exc:
        raise _Invalid(f"policy.json vision is incomplete: {exc}") from None
    problem = vision.problem()
    if problem:
        raise _Invalid(f"policy.json {problem}")
    if not cameras:
        raise _Invalid("policy.json has a vision encoder but no cameras; list the cameras it sees")
    for camera in cameras:
        if camera.size != (vision.image_size, vision.image_size):
            raise _Invalid(f"policy.json camera {camera.name!r} is {camera.height}x{camera.width} but the vision "
                           f"encoder takes {vision.image_size}x{vision.image_size} images; make every camera "
                           "that size")
    return vision


def _read_v3(raw: dict[str, Any], vocab_size: int | None) -> PolicyCard:
    """Version 2's fields, plus the optional ``vision`` (and the ``signed`` scale)."""
    card = _read_v2(raw, vocab_size)
    card.vision = _vision(raw, card.cameras)
    return card


READERS: dict[int, Callable[[dict[str, Any], int | None], PolicyCard]] = {1: _read_v1, 2: _read_v2, 3: _read_v3}
"""``format_version`` → the reader of that version: ``reader(raw, vocab_size)`` → the current :class:`PolicyCard`."""
