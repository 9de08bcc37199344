"""Writing ``policy.json``, the file that lets a server use a checkpoint as a policy.

The trainer and the policy server share only this file's format (version 1,
documented in ``docs/policy-format.md``); neither imports the other. The token
layout is fixed here: state bins first, then action bins, then one token per
task, with the vocabulary rounded up to a multiple of 64.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "evalforge.policy"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TokenLayout:
    """Where state, action and task tokens live in the vocabulary."""

    state_bins: int
    action_bins: int
    num_tasks: int

    @property
    def state_range(self) -> tuple[int, int]:
        return 0, self.state_bins

    @property
    def action_range(self) -> tuple[int, int]:
        return self.state_bins, self.state_bins + self.action_bins

    @property
    def task_range(self) -> tuple[int, int]:
        start = self.action_range[1]
        return start, start + self.num_tasks

    @property
    def vocab_size(self) -> int:
        return -(-self.task_range[1] // 64) * 64


@dataclass
class PolicyCard:
    """Everything policy.json records about a policy."""

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

    @property
    def layout(self) -> TokenLayout:
        return TokenLayout(self.state_bins, self.action_bins, len(self.tasks))

    def to_json(self) -> dict[str, Any]:
        layout = self.layout
        task_start = layout.task_range[0]
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
            "state_bounds": {"low": [float(v) for v in self.state_low], "high": [float(v) for v in self.state_high]},
            "action_bounds": {"low": [float(v) for v in self.action_low],
                              "high": [float(v) for v in self.action_high]},
            "token_ranges": {"state": list(layout.state_range), "action": list(layout.action_range),
                             "task": list(layout.task_range)},
            "tasks": [{"name": name, "token_id": task_start + i, "instruction": self.instructions.get(name, "")}
                      for i, name in enumerate(self.tasks)],
            "provenance": {"source_commit": source_commit(), **self.provenance},
        }

    def write(self, directory: Path) -> Path:
        for name, values, dim in (("state_low", self.state_low, self.state_dim),
                                  ("state_high", self.state_high, self.state_dim),
                                  ("action_low", self.action_low, self.action_dim),
                                  ("action_high", self.action_high, self.action_dim)):
            if len(values) != dim:
                raise ValueError(f"{name} has {len(values)} values for {dim} dimensions")
        if not (np.asarray(self.state_high) > np.asarray(self.state_low)).all() or \
                not (np.asarray(self.action_high) > np.asarray(self.action_low)).all():
            raise ValueError("every high bound must be above its low bound")
        path = directory / "policy.json"
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def source_commit() -> str | None:
    """The git commit of the code that made the checkpoint, if there is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
