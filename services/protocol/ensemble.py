"""Inference settings on the client's side: which of a policy's predicted actions are executed.

A policy answers each request with a chunk of actions; what an evaluation does with the
chunks changes its results by tens of points, so it is a setting of the evaluation
(``inference`` in ``POST /evaluations``), applied here, the same for every protocol:

- default: execute the whole chunk, then ask again (``ActionChunkBroker``);
- ``action_horizon`` k: execute the first k actions of each chunk, then ask again —
  LeRobot's ``n_action_steps``, openpi's ``replan_steps`` (``ActionChunkBroker`` with
  ``actions_per_chunk=k``);
- ``temporal_ensemble`` m: ACT's temporal ensembling (Zhao et al., 2023, "Learning
  Fine-Grained Bimanual Manipulation with Low-Cost Hardware", §3.3): ask for a new chunk at
  every step and execute the weighted average of every action predicted for this step by
  the chunks still covering it, with weights ``exp(-m·i)``, ``i = 0`` for the oldest
  prediction (``TemporalEnsembleBroker``). ``m = 0`` is the plain mean.

``make_broker(client, inference)`` picks one. Every broker has the same face: ``act(obs)``,
``reset(episode_id)``, ``needs_observation`` (the next ``act`` asks the server, so its
observation needs camera frames), ``inferences`` and ``latencies_s``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from services.protocol.client import ActionChunkBroker
from services.protocol.codec import ProtocolError


class Broker(Protocol):
    """What the episode loop drives: one action per step, inferring when it must."""

    latencies_s: list[float]

    @property
    def inferences(self) -> int: ...

    @property
    def needs_observation(self) -> bool: ...

    def act(self, obs: Any) -> np.ndarray: ...

    def reset(self, episode_id: str | None = None) -> None: ...


class TemporalEnsembleBroker:
    """ACT's temporal ensembling over the chunks of a policy client (see the module docstring)."""

    def __init__(self, client: Any, *, weight: float, episode_id: str | None = None) -> None:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"temporal_ensemble weight must be a finite number >= 0, got {weight!r}")
        self.client = client
        self.weight = float(weight)
        self.episode_id = episode_id
        self.latencies_s: list[float] = []
        self._chunks: deque[tuple[int, np.ndarray]] = deque()  # (step it was predicted at, chunk), oldest first
        self._step = 0

    @property
    def inferences(self) -> int:
        return len(self.latencies_s)

    @property
    def needs_observation(self) -> bool:
        return True  # every step asks for a new chunk

    def act(self, obs: Any) -> np.ndarray:
        """The ensembled action for this step: a new chunk is asked for, then averaged with the older ones."""
        start = time.perf_counter()
        reply = self.client.infer(obs, episode_id=self.episode_id, step=self._step)
        self.latencies_s.append(time.perf_counter() - start)
        chunk = reply.actions
        if chunk.ndim != 2 or len(chunk) == 0:
            raise ProtocolError(f"expected an action chunk of shape [chunk, action_dim], got {list(chunk.shape)}")
        self._chunks.append((self._step, chunk))
        while self._step - self._chunks[0][0] >= len(self._chunks[0][1]):
            self._chunks.popleft()  # predicts no action for this step or any later one
        predictions = np.stack([c[self._step - first] for first, c in self._chunks
                                if self._step - first < len(c)]).astype(np.float64)
        weights = np.exp(-self.weight * np.arange(len(predictions)))
        self._step += 1
        return (weights[:, None] * predictions).sum(axis=0).astype(np.float32) / np.float32(weights.sum())

    def reset(self, episode_id: str | None = None) -> None:
        self._chunks.clear()
        self._step = 0
        self.episode_id = episode_id


def make_broker(client: Any, inference: Mapping[str, Any] | None, *, episode_id: str | None = None) -> Broker:
    """The broker an evaluation's ``inference`` settings ask for (``None`` or ``{}``: the defaults)."""
    inference = inference or {}
    unknown = set(inference) - {"action_horizon", "temporal_ensemble"}
    if unknown:
        raise ValueError(f"unknown inference setting(s) {', '.join(sorted(unknown))}; known: action_horizon, "
                         "temporal_ensemble")
    if inference.get("temporal_ensemble") is not None:
        if inference.get("action_horizon") is not None:
            raise ValueError("action_horizon and temporal_ensemble exclude each other")
        return TemporalEnsembleBroker(client, weight=float(inference["temporal_ensemble"]), episode_id=episode_id)
    return ActionChunkBroker(client, episode_id=episode_id, actions_per_chunk=inference.get("action_horizon"))
