"""Reading ``policy.json``: the whole contract between a checkpoint and this server.

A policy checkpoint is a directory that ``transformers`` and ``vllm`` both load as
a causal LM (``config.json`` + ``model.safetensors`` or a sharded index), plus
``policy.json``, which says how observations become prompt token ids and how
generated token ids become continuous actions. Format version 1::

    {
      "format": "evalforge.policy", "format_version": 1,
      "name": "reach-bc", "suite": "metaworld-mt1-reach",
      "state_dim": 39, "action_dim": 4, "chunk_size": 4,
      "state_bins": 256, "action_bins": 256,
      "state_bounds":  {"low": [...state_dim], "high": [...state_dim]},
      "action_bounds": {"low": [...action_dim], "high": [...action_dim]},
      "token_ranges": {"state": [0, 256], "action": [256, 512], "task": [512, 513]},
      "tasks": [{"name": "reach-v3", "token_id": 512, "instruction": "Reach the goal."}],
      "provenance": {"dataset": "...", "steps": 2000, "source_commit": "..."}
    }

Token ranges are half-open ``[start, end)``, must not overlap, and must fit in the
model's vocabulary. The prompt is ``[task token] + one token per state dimension``;
the model generates ``chunk_size * action_dim`` tokens from the action range,
row by row. Values map to bins uniformly between their bounds::

    bin   = clip(floor((x - low) / (high - low) * bins), 0, bins - 1)
    value = low + (bin + 0.5) / bins * (high - low)

The trainer writes this file with code of its own; the two sides share only this
format, so that serving a policy needs no Python from the trainer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "evalforge.policy"
FORMAT_VERSION = 1
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served, with what is wrong in it."""


@dataclass(frozen=True)
class TaskEntry:
    name: str
    token_id: int
    instruction: str


@dataclass(frozen=True)
class PolicySpec:
    """A validated ``policy.json`` plus what the server derives from it."""

    directory: Path
    name: str
    suite: str | None
    state_dim: int
    action_dim: int
    chunk_size: int
    state_bins: int
    action_bins: int
    state_low: np.ndarray
    state_high: np.ndarray
    action_low: np.ndarray
    action_high: np.ndarray
    state_range: tuple[int, int]
    action_range: tuple[int, int]
    task_range: tuple[int, int]
    tasks: dict[str, TaskEntry]
    vocab_size: int
    provenance: dict[str, Any]
    checkpoint_sha256: str

    @property
    def max_tokens(self) -> int:
        """Tokens generated per inference: one action chunk."""
        return self.chunk_size * self.action_dim

    @property
    def prompt_len(self) -> int:
        return 1 + self.state_dim

    @property
    def allowed_token_ids(self) -> list[int]:
        return list(range(*self.action_range))

    @cached_property
    def _state_scale(self) -> np.ndarray:
        return self.state_bins / (self.state_high - self.state_low)

    @cached_property
    def _action_values(self) -> np.ndarray:
        """float32 ``[action_bins, action_dim]``: the value of each bin in each dimension."""
        centres = (np.arange(self.action_bins)[:, None] + 0.5) / self.action_bins
        return (self.action_low + centres * (self.action_high - self.action_low)).astype(np.float32)

    @cached_property
    def _action_dims(self) -> np.ndarray:
        """The action dimension of each generated token: 0, 1, …, action_dim − 1, repeated per chunk row."""
        return np.tile(np.arange(self.action_dim), self.chunk_size)

    def prompt_tokens(self, state: np.ndarray, task: str) -> list[int]:
        """Prompt token ids for one observation (state already validated: finite)."""
        scaled = (state - self.state_low) * self._state_scale
        # clipped to [0, bins − 1] first, truncation is the floor: the bin index
        bins = np.minimum(np.maximum(scaled, 0.0), self.state_bins - 1).astype(np.int64)
        return [self.tasks[task].token_id, *(bins + self.state_range[0]).tolist()]

    def decode_actions(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """float32 ``[chunk_size, action_dim]`` from generated action-token ids."""
        ids = token_ids if isinstance(token_ids, list) else np.asarray(token_ids).tolist()
        if len(ids) != self.max_tokens:
            raise ValueError(f"expected {self.max_tokens} action tokens, got {len(ids)}")
        start, end = self.action_range
        if min(ids) < start or max(ids) >= end:
            raise ValueError("generated a token outside the action range")
        bins = np.asarray(ids, dtype=np.int64) - start
        return self._action_values[bins, self._action_dims].reshape(self.chunk_size, self.action_dim)


def _fail(directory: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {directory}: {problem}")


def _int(raw: dict, key: str, directory: Path, minimum: int = 1) -> int:
    value = raw.get(key)
    if type(value) is not int or value < minimum:
        raise _fail(directory, f"policy.json field '{key}' must be an integer ≥ {minimum}, got {value!r}")
    return value


def _bounds(raw: dict, key: str, dim: int, directory: Path) -> tuple[np.ndarray, np.ndarray]:
    bounds = raw.get(key)
    if not isinstance(bounds, dict) or "low" not in bounds or "high" not in bounds:
        raise _fail(directory, f"policy.json field '{key}' must be {{\"low\": [...], \"high\": [...]}}")
    low = np.asarray(bounds["low"], dtype=np.float64)
    high = np.asarray(bounds["high"], dtype=np.float64)
    if low.shape != (dim,) or high.shape != (dim,):
        raise _fail(directory, f"policy.json '{key}' must have {dim} lows and highs, got {low.shape} and {high.shape}")
    if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high <= low).any():
        raise _fail(directory, f"policy.json '{key}' must be finite with high > low in every dimension")
    return low, high


def _range(ranges: dict, key: str, directory: Path) -> tuple[int, int]:
    value = ranges.get(key)
    if (not isinstance(value, list) or len(value) != 2 or not all(type(v) is int for v in value)
            or not 0 <= value[0] < value[1]):
        raise _fail(directory, f"policy.json token_ranges.{key} must be [start, end) with 0 ≤ start < end, got {value!r}")
    return value[0], value[1]


def checkpoint_digest(directory: Path) -> str:
    """sha256 over the names and bytes of the files that define the policy."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.suffix in {".json", ".safetensors"}):
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as handle:
                while block := handle.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()


def load_policy_spec(directory: str | Path) -> PolicySpec:
    """Validate a checkpoint directory and return its spec, or raise ``CheckpointError``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} is not a directory")
    missing = [name for name in ("config.json", "policy.json") if not (directory / name).is_file()]
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise _fail(directory, f"missing {', '.join(missing)} (a policy checkpoint needs config.json, weights and policy.json)")
    try:
        raw = json.loads((directory / "policy.json").read_text())
        config = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise _fail(directory, f"invalid JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _fail(directory, f"policy.json must have \"format\": \"{FORMAT}\"")
    if raw.get("format_version") != FORMAT_VERSION:
        raise _fail(directory, f"policy.json format_version {raw.get('format_version')!r} is not supported; "
                               f"this server reads version {FORMAT_VERSION}")
    vocab_size = config.get("vocab_size")
    if type(vocab_size) is not int or vocab_size <= 0:
        raise _fail(directory, "config.json has no integer vocab_size")

    state_dim = _int(raw, "state_dim", directory)
    action_dim = _int(raw, "action_dim", directory)
    chunk_size = _int(raw, "chunk_size", directory)
    state_bins = _int(raw, "state_bins", directory, minimum=2)
    action_bins = _int(raw, "action_bins", directory, minimum=2)
    state_low, state_high = _bounds(raw, "state_bounds", state_dim, directory)
    action_low, action_high = _bounds(raw, "action_bounds", action_dim, directory)

    ranges = raw.get("token_ranges")
    if not isinstance(ranges, dict):
        raise _fail(directory, "policy.json needs token_ranges with state, action and task")
    state_range = _range(ranges, "state", directory)
    action_range = _range(ranges, "action", directory)
    task_range = _range(ranges, "task", directory)
    if state_range[1] - state_range[0] != state_bins:
        raise _fail(directory, f"token_ranges.state holds {state_range[1] - state_range[0]} ids but state_bins is {state_bins}")
    if action_range[1] - action_range[0] != action_bins:
        raise _fail(directory, f"token_ranges.action holds {action_range[1] - action_range[0]} ids but action_bins is {action_bins}")
    ordered = sorted([("state", state_range), ("action", action_range), ("task", task_range)], key=lambda r: r[1])
    for (name_a, a), (name_b, b) in zip(ordered, ordered[1:], strict=False):
        if a[1] > b[0]:
            raise _fail(directory, f"token_ranges.{name_a} {list(a)} overlaps token_ranges.{name_b} {list(b)}")
    top = max(state_range[1], action_range[1], task_range[1])
    if top > vocab_size:
        raise _fail(directory, f"token ranges reach id {top - 1} but the model's vocabulary has only {vocab_size} ids")

    tasks: dict[str, TaskEntry] = {}
    for entry in raw.get("tasks") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or type(entry.get("token_id")) is not int:
            raise _fail(directory, f"policy.json task entry {entry!r} needs a string name and an integer token_id")
        token_id = entry["token_id"]
        if not task_range[0] <= token_id < task_range[1]:
            raise _fail(directory, f"task {entry['name']!r} has token_id {token_id} outside token_ranges.task {list(task_range)}")
        if entry["name"] in tasks or any(t.token_id == token_id for t in tasks.values()):
            raise _fail(directory, f"task {entry['name']!r} or its token_id {token_id} appears twice")
        tasks[entry["name"]] = TaskEntry(entry["name"], token_id, str(entry.get("instruction", "")))
    if not tasks:
        raise _fail(directory, "policy.json lists no tasks")

    return PolicySpec(
        directory=directory,
        name=str(raw.get("name") or directory.name),
        suite=raw.get("suite"),
        state_dim=state_dim,
        action_dim=action_dim,
        chunk_size=chunk_size,
        state_bins=state_bins,
        action_bins=action_bins,
        state_low=state_low,
        state_high=state_high,
        action_low=action_low,
        action_high=action_high,
        state_range=state_range,
        action_range=action_range,
        task_range=task_range,
        tasks=tasks,
        vocab_size=vocab_size,
        provenance=raw.get("provenance") or {},
        checkpoint_sha256=checkpoint_digest(directory),
    )
