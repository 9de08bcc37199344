"""A policy's tokens: the vocabulary layout, state and action binning, and the one sequence builder.

A policy is a causal LM over a small vocabulary cut into half-open ``[start, end)`` ranges
(:class:`TokenLayout`): one id per state bin, one per action bin, one per task. The
trainer's training sequences and the policy server's prompts are the same list, built by
one function, :meth:`PolicyTokenizer.sequence`::

    [task, s_1 … s_D]                                   the prompt of one observation
    [task, s_1 … s_D, a(t)_1 … a(t)_A … a(t+H−1)_A]     a training sequence (H = chunk_size)

and the model generates the ``H × A`` action tokens row by row (row 0's ``A`` values,
then row 1's …). Vision policies insert ``image_len`` image rows between the task token
and the state tokens (``tokens_per_image`` per camera, cameras in card order)::

    [task, img_1 … img_N, s_1 … s_D, a(t)_1 … ]

The id sequence holds :data:`IMAGE_PLACEHOLDER_ID` at image positions
(:attr:`PolicyTokenizer.image_slice`); the trainer and the engines replace those
positions' embeddings with the projected image features, so the placeholder's own
embedding is never used.

**Binning** is uniform between per-dimension bounds, ``bins`` bins for every dimension::

    bin   = clip(floor((x − low) · (bins / (high − low))), 0, bins − 1)      token = range start + bin
    value = low + (bin + 0.5) / bins · (high − low)                           (de-binning: the bin's centre)

evaluated one way only — bounds in float64, values promoted to float64, the scale
``bins / (high − low)`` computed first — so a state gives the same bins bit for bit
wherever it is binned. Values outside the bounds fall into the edge bins. The floor is
the truncation of the clipped value (both are the same on ``[0, bins − 1]``), which
saves the server a ufunc per request.

This module is numpy and the standard library only; it imports nothing of EvalForge's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

# the trainer rounds a model's vocabulary up to a multiple of this (a friendlier matrix size)
VOCAB_MULTIPLE = 64
IMAGE_PLACEHOLDER_ID = 0
"""The id at image-row positions of a vision policy's sequences (its embedding is replaced, never read)."""


@dataclass(frozen=True)
class TokenLayout:
    """Where state, action and task tokens live in the vocabulary: half-open ``[start, end)`` ranges."""

    state_range: tuple[int, int]
    action_range: tuple[int, int]
    task_range: tuple[int, int]

    @classmethod
    def packed(cls, state_bins: int, action_bins: int, num_tasks: int) -> TokenLayout:
        """The layout the trainer gives its policies: state bins from id 0, then action bins, then one id per task."""
        return cls((0, state_bins), (state_bins, state_bins + action_bins),
                   (state_bins + action_bins, state_bins + action_bins + num_tasks))

    @property
    def ranges(self) -> dict[str, tuple[int, int]]:
        """``{"state": …, "action": …, "task": …}``, the order policy.json writes them in."""
        return {"state": self.state_range, "action": self.action_range, "task": self.task_range}

    @property
    def state_bins(self) -> int:
        return self.state_range[1] - self.state_range[0]

    @property
    def action_bins(self) -> int:
        return self.action_range[1] - self.action_range[0]

    @property
    def num_tasks(self) -> int:
        return self.task_range[1] - self.task_range[0]

    @property
    def end(self) -> int:
        """One past the highest id of any range: the smallest vocabulary that holds them all."""
        return max(end for _, end in self.ranges.values())

    @property
    def vocab_size(self) -> int:
        """The vocabulary the trainer gives a model of this layout: :attr:`end` rounded up to a multiple of 64."""
        return -(-self.end // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def overlap(self) -> tuple[str, str] | None:
        """The names of two ranges that overlap, or None."""
        ordered = sorted(self.ranges.items(), key=lambda item: item[1])
        for (name_a, a), (name_b, b) in zip(ordered, ordered[1:], strict=False):
            if a[1] > b[0]:
                return name_a, name_b
        return None


class UniformTokenizer:
    """``bins`` equal bins per dimension between ``low`` and ``high``; bin ``b`` is token ``first_id + b``.

    :class:`StateTokenizer` and :class:`ActionTokenizer` are the two kinds a policy has.
    """

    kind: ClassVar[str] = "value"

    def __init__(self, low: ArrayLike, high: ArrayLike, bins: int, first_id: int = 0) -> None:
        low = np.array(low, dtype=np.float64)
        high = np.array(high, dtype=np.float64)
        if low.ndim != 1 or low.shape != high.shape or low.size == 0:
            raise ValueError(f"{self.kind} bounds must be two 1-D arrays of one length, got shapes "
                             f"{low.shape} and {high.shape}")
        if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high <= low).any():
            raise ValueError(f"{self.kind} bounds must be finite with high > low in every dimension")
        if type(bins) is not int or bins < 2:
            raise ValueError(f"{self.kind} bins must be an integer ≥ 2, got {bins!r}")
        if type(first_id) is not int or first_id < 0:
            raise ValueError(f"{self.kind} token ids must start at an integer ≥ 0, got {first_id!r}")
        low.flags.writeable = high.flags.writeable = False
        self.low, self.high, self.bins, self.first_id = low, high, bins, first_id
        self.scale = bins / (high - low)
        """``bins / (high − low)``, computed first (see the module docstring)."""
        centres = (np.arange(bins, dtype=np.float64)[:, None] + 0.5) / bins
        self.centres = (low + centres * (high - low)).astype(np.float32)
        """float32 ``[bins, dim]``: the value of each bin in each dimension (de-binning is a lookup)."""
        self.centres.flags.writeable = False
        self._dims = np.arange(self.dim)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, bins={self.bins}, token_range={self.token_range})"

    @property
    def dim(self) -> int:
        return int(self.low.shape[0])

    @property
    def token_range(self) -> tuple[int, int]:
        return self.first_id, self.first_id + self.bins

    def _clipped(self, values: ArrayLike) -> np.ndarray:
        """float64 ``(values − low) · scale`` clipped to ``[0, bins − 1]``: truncated, the bins."""
        values = np.asarray(values)
        if values.ndim == 0 or values.shape[-1] != self.dim:
            raise ValueError(f"{self.kind} values must have {self.dim} dimensions (shape [..., {self.dim}]), "
                             f"got shape {list(values.shape)}")
        scaled = values - self.low
        scaled *= self.scale
        np.maximum(scaled, 0.0, out=scaled)
        return np.minimum(scaled, self.bins - 1, out=scaled)

    def to_bins(self, values: ArrayLike) -> np.ndarray:
        """int64 bins ``[..., dim]`` of ``values`` ``[..., dim]``, clipped to ``[0, bins)``."""
        return self._clipped(values).astype(np.int64)

    def from_bins(self, bins: ArrayLike) -> np.ndarray:
        """float32 bin centres ``[..., dim]`` of ``bins`` ``[..., dim]`` (each in ``[0, bins)``)."""
        return self.centres[np.asarray(bins, dtype=np.int64), self._dims]

    def encode(self, values: ArrayLike, out: np.ndarray | None = None) -> np.ndarray:
        """int64 token ids ``[..., dim]`` of ``values`` ``[..., dim]`` (written into ``out`` if given)."""
        clipped = self._clipped(values)
        if out is None:
            out = np.empty(clipped.shape, dtype=np.int64)
        out[...] = clipped  # the cast truncates: the bins
        out += self.first_id
        return out

    def decode(self, token_ids: ArrayLike) -> np.ndarray:
        """float32 values ``[..., dim]`` of token ids ``[..., dim]``; ids outside the range are refused."""
        bins = np.asarray(token_ids, dtype=np.int64) - self.first_id
        if bins.size and (bins.min() < 0 or bins.max() >= self.bins):
            raise ValueError(f"a token id is outside the {self.kind} range {list(self.token_range)}")
        return self.from_bins(bins)


class StateTokenizer(UniformTokenizer):
    """State vectors ↔ state tokens (one per dimension)."""

    kind = "state"


class ActionTokenizer(UniformTokenizer):
    """Actions ↔ action tokens (one per dimension); a chunk ``[H, A]`` flattens row by row."""

    kind = "action"


class PolicyTokenizer:
    """Tasks, states and action chunks ↔ the token ids of one policy.

    Build it from the policy's card (:meth:`policy_format.PolicyCard.tokenizer`), as both the
    trainer and the policy server do, so that both sides tokenize with the same bounds,
    bins and ids.
    """

    def __init__(self, task_ids: Mapping[str, int], state: StateTokenizer, action: ActionTokenizer,
                 chunk_size: int, layout: TokenLayout, *, image_len: int = 0) -> None:
        if not task_ids:
            raise ValueError("a policy needs at least one task")
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer ≥ 1, got {chunk_size!r}")
        self.task_ids: dict[str, int] = dict(task_ids)
        """Task name → its token id, in the card's task order."""
        self.state, self.action, self.chunk_size, self.layout = state, action, chunk_size, layout
        self.state_dim, self.action_dim = state.dim, action.dim
        if type(image_len) is not int or image_len < 0:
            raise ValueError(f"image_len must be an integer ≥ 0, got {image_len!r}")
        self.image_len = image_len
        """Image rows in a prompt (0: a state-only policy)."""
        self.image_slice = slice(1, 1 + image_len)
        """Where the image rows are in a prompt (and a training sequence)."""
        self.prompt_len = 1 + image_len + state.dim
        """Tokens in a prompt: the task token, the image rows and one per state dimension."""
        self.action_len = chunk_size * action.dim
        """Action tokens generated per inference (one chunk): ``chunk_size × action_dim``."""
        self.seq_length = self.prompt_len + self.action_len
        """Tokens in a training sequence: the prompt, then one action chunk."""
        self._chunk_dims = np.tile(np.arange(action.dim), chunk_size)  # the dimension of each generated token

    @property
    def tasks(self) -> list[str]:
        return list(self.task_ids)

    @property
    def allowed_token_ids(self) -> list[int]:
        """The ids a policy may generate: the action range."""
        return list(range(*self.action.token_range))

    def task_token(self, task: str) -> int:
        try:
            return self.task_ids[task]
        except KeyError:
            raise KeyError(f"task {task!r} is not one of this policy's tasks {self.tasks}") from None

    def sequence(self, task: str | Sequence[str], state: ArrayLike, actions: ArrayLike | None = None) -> np.ndarray:
        """int64 token ids ``[task, images…, s_1 … s_D]`` — a prompt — and, given ``actions``, the action chunk.

        The one builder of prompts (the policy server) and training sequences (the trainer).
        Leading dimensions batch: ``state`` is ``[..., D]``, ``task`` one name or one name per
        row, ``actions`` ``[..., chunk_size, A]``; the result is ``[..., L]``.
        """
        states = np.asarray(state)
        lead = states.shape[:-1]
        # filled in place: cheaper than concatenating, on the server's per-request path
        out = np.empty((*lead, self.prompt_len if actions is None else self.seq_length), dtype=np.int64)
        if isinstance(task, str):
            out[..., 0] = self.task_token(task)
        else:
            tasks = np.array([self.task_token(t) for t in task], dtype=np.int64)
            if tasks.size != int(np.prod(lead)):
                raise ValueError(f"{tasks.size} tasks for {int(np.prod(lead))} states")
            out[..., 0] = tasks.reshape(lead)
        if self.image_len:
            out[..., self.image_slice] = IMAGE_PLACEHOLDER_ID
        self.state.encode(states, out=out[..., 1 + self.image_len:self.prompt_len])
        if actions is not None:
            chunk = np.asarray(actions)
            if chunk.shape != (*lead, self.chunk_size, self.action_dim):
                raise ValueError(f"actions must have shape {[*lead, self.chunk_size, self.action_dim]} "
                                 f"(states' leading dims, chunk_size, action_dim), got {list(chunk.shape)}")
            out[..., self.prompt_len:] = self.action.encode(chunk).reshape(*lead, self.action_len)
        return out

    def prompt(self, task: str, state: ArrayLike) -> list[int]:
        """The prompt of one observation as a list of ids (what inference engines take): :meth:`sequence`'s."""
        return self.sequence(task, state).tolist()

    def decode_actions(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 ``[chunk_size, action_dim]`` from ``chunk_size × action_dim`` generated action-token ids."""
        # a list (what engines return) is checked in Python: cheaper than numpy for a chunk's few ids
        ids = token_ids if isinstance(token_ids, list) else np.asarray(token_ids).reshape(-1).tolist()
        if len(ids) != self.action_len:
            raise ValueError(f"expected {self.action_len} action tokens, got {len(ids)}")
        start, end = self.action.token_range
        if min(ids) < start or max(ids) >= end:
            raise ValueError(f"generated a token outside the action range [{start}, {end})")
        bins = np.asarray(ids, dtype=np.int64) - start
        return self.action.centres[bins, self._chunk_dims].reshape(self.chunk_size, self.action_dim)
