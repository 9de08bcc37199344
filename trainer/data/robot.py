"""Robot demonstrations → token sequences for a discretised-action policy (what ``trainer vla`` trains on).

The pipeline, one piece per step::

    dataset = DemonstrationDataset("runs/demos/reach-50")      # ours, or recorded by LeRobot (v3 layout)
    card = dataset_card(dataset, name="reach", chunk_size=4)   # bounds from meta/stats.json, tasks, layout
    samples = RobotSamples(dataset, card.tokenizer())          # one sample per frame
    batches = RobotBatches(samples, micro_batch_size=32, global_batch_size=32, seed=0)
    batch = next(batches)   # tokens, labels, loss_mask, position_ids (trainer/loop.py's batch source)

**Normalisation bounds** (:func:`normalization_bounds`) come from ``meta/stats.json``, per
dimension: ``q01``/``q99`` (``"quantile"``, the default: a few outlier frames do not
stretch the bins) or ``min``/``max`` (``"min_max"``). A dimension whose bounds are closer
than ``min_range`` (a constant joint, an unused object slot, a gripper never used) is
widened symmetrically around its centre to ``max(min_range, 1e-5·|centre|)``, since
``policy.json`` needs ``high > low`` and a zero-width bin is undefined. Values outside the
bounds fall into the edge bins.

**Binning, token layout and sequences** are ``policy_format``'s, the very code the policy
server prompts with: :func:`dataset_card` gives the policy's :class:`~policy_format.PolicyCard`
(the packed :class:`~policy_format.TokenLayout`: state bins, then action bins, then one
token per task in the dataset's task order), and every batch is built by
:meth:`policy_format.PolicyTokenizer.sequence`. A sample is frame ``t`` of an episode of
length ``T``::

    [task token, s_1 … s_D, a(t)_1 … a(t)_A, a(t+1)_1 … a(t+H−1)_A]      L = 1 + D + H·A tokens

with the action chunk ``a(t) … a(t+H−1)`` (``H = chunk_size``) padded past the episode's
end by repeating its last action, which teaches the policy to hold still once done rather
than to invent motion it never saw.

**Labels and loss mask** follow the loop's next-token convention (``trainer/loop.py``;
``trainer/data/sft.py`` does the same): a row has the sample's ``L`` tokens, and at position
``j``::

    tokens[j] = seq[j]    labels[j] = seq[j+1] (0 at j = L−1)    position_ids[j] = j
    loss_mask[j] = 1  iff  seq[j+1] is an action token  (D ≤ j ≤ L−2)

so only the ``H·A`` action tokens are trained; the prompt (task and state) carries no loss.
The last position predicts nothing (its label is a placeholder, always a valid id).

**Augmentation** (optional, ``state_noise > 0``): each batch bins its states after adding
Gaussian noise of ``state_noise × (high − low)`` per dimension, so a policy trained on few
demonstrations cannot key its actions on exact state tokens of the episodes it saw
(which objects' positions, irrelevant to the task, would let it do); actions stay exact.
On 50 MetaWorld reach demos, 0.02 raised held-out success from about 40 % to 70 %.

**Batching** (:class:`RobotBatches`): an endless stream of epochs, each a permutation of all
samples drawn from ``numpy.random.default_rng([seed, epoch])``, so position ``k`` of the
stream is known without replaying it; global batch ``s`` is stream positions
``[s·G, (s+1)·G)``, of which data-parallel rank ``r`` takes the ``r``-th block of
``G / dp``. ``state_dict()`` is the number of samples consumed, so resume is exact and
O(1), under any data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from policy_format import PolicyCard, PolicyTokenizer
from trainer.config import ConfigError
from trainer.data.lerobot import ACTION, STATE, DatasetError, DemonstrationDataset

Normalization = Literal["quantile", "min_max"]
_STAT_KEYS: dict[str, tuple[str, str]] = {"quantile": ("q01", "q99"), "min_max": ("min", "max")}
# relative floor of a widened dimension's width: float32 values near |c| are ~6e-8·|c| apart,
# so a width of 1e-5·|c| still spans well over a hundred representable values
_RELATIVE_MIN_RANGE = 1e-5
# frames tokenised per call at construction: bounds the float64 temporaries (≈ 30 MB at 39 state dims)
_BUILD_BLOCK = 1 << 16


def normalization_bounds(stats: Mapping[str, Any], feature: str, dim: int, *, mode: Normalization = "quantile",
                         min_range: float = 1e-3,
                         source: Path | str = "meta/stats.json") -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension ``(low, high)`` (float64) of ``feature`` from LeRobot stats, degenerate ones widened."""
    if mode not in _STAT_KEYS:
        raise ConfigError(f"data.normalization {mode!r} is unknown; choose 'quantile' (q01/q99) or 'min_max'")
    low_key, high_key = _STAT_KEYS[mode]
    entry = stats.get(feature)
    if not isinstance(entry, Mapping):
        raise DatasetError(f"{source}: no statistics for '{feature}'; recompute the dataset's stats")
    bounds = []
    for key in (low_key, high_key):
        values = entry.get(key)
        if values is None:
            hint = (" (older LeRobot datasets have no quantiles: set data.normalization: min_max, or recompute the "
                    "stats)") if mode == "quantile" else ""
            raise DatasetError(f"{source}: '{feature}' has no '{key}' statistics{hint}")
        try:
            array = np.asarray(values, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise DatasetError(f"{source}: '{feature}' {key} must be a list of numbers, got {values!r}") from None
        if array.shape != (dim,):
            raise DatasetError(f"{source}: '{feature}' {key} has {array.size} values, info.json says {dim} dimensions")
        if not np.isfinite(array).all():
            bad = int(np.flatnonzero(~np.isfinite(array))[0])
            raise DatasetError(f"{source}: '{feature}' {key} is {array[bad]} in dimension {bad}; the dataset holds "
                               "NaN or infinite values — recompute the stats after dropping the bad episodes")
        bounds.append(array)
    low, high = bounds
    if (high < low).any():
        bad = int(np.flatnonzero(high < low)[0])
        raise DatasetError(f"{source}: '{feature}' {high_key} < {low_key} in dimension {bad}; the stats are corrupt")
    return widen_degenerate(low, high, min_range)


def widen_degenerate(low: np.ndarray, high: np.ndarray, min_range: float) -> tuple[np.ndarray, np.ndarray]:
    """Bounds narrower than ``max(min_range, 1e-5·|centre|)`` widened to it, around their centre."""
    if min_range <= 0:
        raise ConfigError(f"data.min_range must be positive, got {min_range}")
    low, high = np.array(low, dtype=np.float64), np.array(high, dtype=np.float64)
    centre = (low + high) / 2
    width = np.maximum(min_range, _RELATIVE_MIN_RANGE * np.abs(centre))
    narrow = (high - low) < width
    low[narrow] = centre[narrow] - width[narrow] / 2
    high[narrow] = centre[narrow] + width[narrow] / 2
    return low, high


def dataset_card(dataset: DemonstrationDataset, *, name: str, chunk_size: int = 4, state_bins: int = 256,
                 action_bins: int = 256, mode: Normalization = "quantile", min_range: float = 1e-3,
                 suite: str | None = None) -> PolicyCard:
    """The card of a policy trained on ``dataset``: its tasks and instructions, bounds from its stats.

    The token layout is the packed one (state bins, action bins, one token per task in the
    dataset's task order); ``card.tokenizer()`` is what :class:`RobotSamples` tokenises with.
    """
    if chunk_size < 1:
        raise ConfigError(f"data.chunk_size must be at least 1, got {chunk_size}")
    source = dataset.root / "meta/stats.json"
    state_low, state_high = normalization_bounds(dataset.stats, STATE, dataset.state_dim, mode=mode,
                                                 min_range=min_range, source=source)
    action_low, action_high = normalization_bounds(dataset.stats, ACTION, dataset.action_dim, mode=mode,
                                                   min_range=min_range, source=source)
    return PolicyCard(name=name, suite=suite, state_dim=dataset.state_dim, action_dim=dataset.action_dim,
                      chunk_size=chunk_size, tasks=list(dataset.tasks), instructions=dict(dataset.instructions),
                      state_low=state_low.tolist(), state_high=state_high.tolist(),
                      action_low=action_low.tolist(), action_high=action_high.tolist(),
                      state_bins=state_bins, action_bins=action_bins)


class RobotSamples:
    """One training sample per frame of ``dataset``, tokenised once up front.

    Every frame's sequence is built at construction by the tokenizer's ``sequence`` (the
    policy server's prompt builder), in blocks, into ``uint16``/``int32`` rows of ``L``
    tokens (a few bytes per value, so millions of frames fit); a batch then only gathers
    rows — the chunk's frames are ``min(t + h, last frame of the episode)``. With
    augmentation the float states and actions are kept too, and each batch is built anew.
    """

    def __init__(self, dataset: DemonstrationDataset, tokenizer: PolicyTokenizer, *,
                 state_noise: float = 0.0, images: Any = None, environment_state: np.ndarray | None = None) -> None:
        if state_noise < 0:
            raise ConfigError(f"data.state_noise must be ≥ 0, got {state_noise}")
        if (dataset.state_dim, dataset.action_dim) != (tokenizer.state_dim, tokenizer.action_dim):
            raise DatasetError(f"{dataset.root}: state/action dims {dataset.state_dim}/{dataset.action_dim} do not "
                               f"match the tokenizer's {tokenizer.state_dim}/{tokenizer.action_dim}")
        unknown = sorted({ep.task for ep in dataset.episodes} - set(tokenizer.tasks))
        if unknown:
            raise DatasetError(f"{dataset.root}: episodes of tasks {unknown} have no task token")
        if not dataset.episodes:
            raise DatasetError(f"{dataset.root}: holds no episodes")
        self.tokenizer = tokenizer
        self.state_noise = state_noise
        self.images = images
        """A vision policy's ``trainer.vision.CameraImages``: batches gain ``pixel_values``."""
        if environment_state is not None and len(environment_state) != dataset.num_frames:
            raise DatasetError(f"{dataset.root}: {len(environment_state)} environment-state targets for "
                               f"{dataset.num_frames} frames")
        self.environment_state = environment_state
        """float32 ``[frames, E]`` auxiliary targets (``vision.environment_state_loss``): batches gain them."""
        self.augments = state_noise > 0 or (images is not None and bool(images.shift or images.color_jitter))
        self._task_names = tokenizer.tasks
        states = np.concatenate([ep.state for ep in dataset.episodes])
        actions = np.concatenate([ep.action for ep in dataset.episodes])
        lengths = np.array([ep.length for ep in dataset.episodes], dtype=np.int64)
        ends = np.cumsum(lengths)
        self.last_frame = np.repeat(ends - 1, lengths)  # [frames]: global index of the episode's last frame
        self.task_index = np.repeat([self._task_names.index(ep.task) for ep in dataset.episodes], lengths)
        self._chunk_offsets = np.arange(tokenizer.chunk_size, dtype=np.int64)
        self._noise_scale = state_noise * (tokenizer.state.high - tokenizer.state.low)
        token_dtype = np.uint16 if tokenizer.layout.end <= 1 << 16 else np.int32
        self.tokens = np.empty((len(states), tokenizer.seq_length), dtype=token_dtype)
        for start in range(0, len(states), _BUILD_BLOCK):
            block = np.arange(start, min(start + _BUILD_BLOCK, len(states)))
            self.tokens[block] = self._build(block, states[block], actions)
        # float states and actions only for augmentation: each batch bins noisy states anew
        self._states = states if state_noise > 0 else None
        self._actions = actions if state_noise > 0 else None
        seq = tokenizer.seq_length
        self._labels_mask = np.zeros(seq, dtype=np.float32)
        self._labels_mask[tokenizer.prompt_len - 1: seq - 1] = 1.0
        self._positions = np.arange(seq, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        return self.tokenizer.seq_length

    def _build(self, indices: np.ndarray, states: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """int64 ``[b, L]`` sequences of frames ``indices`` with ``states`` (``[b, D]``) and all frames' ``actions``."""
        frames = np.minimum(indices[:, None] + self._chunk_offsets, self.last_frame[indices][:, None])
        tasks = [self._task_names[i] for i in self.task_index[indices]]
        return self.tokenizer.sequence(tasks, states, actions[frames])

    def sequences(self, indices: np.ndarray, noise: np.random.Generator | None = None) -> np.ndarray:
        """int64 ``[b, L]``: ``[task, states…, action chunk…]`` for each frame index.

        With ``noise`` (and ``state_noise > 0``) the states are binned after adding Gaussian
        noise of ``state_noise × (high − low)`` per dimension; the actions are not.
        """
        indices = np.asarray(indices, dtype=np.int64)
        if noise is not None and self._states is not None:
            noisy = self._states[indices] + noise.standard_normal((len(indices), self._states.shape[1])) \
                * self._noise_scale
            return self._build(indices, noisy, self._actions)
        return self.tokens[indices].astype(np.int64)

    def batch(self, indices: np.ndarray, noise: np.random.Generator | None = None) -> dict[str, torch.Tensor]:
        """The loop's micro-batch (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, and a vision
        policy's ``pixel_values``) for ``indices``; ``noise`` also draws the image augmentation."""
        seq = self.sequences(indices, noise)
        labels = np.zeros_like(seq)
        labels[:, :-1] = seq[:, 1:]
        b = seq.shape[0]
        return {
            "tokens": torch.from_numpy(seq),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(np.broadcast_to(self._labels_mask, (b, self.seq_length)).copy()),
            "position_ids": torch.from_numpy(np.broadcast_to(self._positions, (b, self.seq_length)).copy()),
            **({"pixel_values": self.images.pixel_values(indices, noise)} if self.images is not None else {}),
            **({"environment_state": torch.from_numpy(self.environment_state[np.asarray(indices)])}
               if self.environment_state is not None else {}),
        }


class RobotBatches:
    """This data-parallel rank's micro-batches: seeded epoch permutations, exact O(1) resume.

    Yields forever (epoch after epoch); the loop stops at ``schedule.train_steps``.
    """

    def __init__(self, samples: RobotSamples, *, micro_batch_size: int, global_batch_size: int, seed: int,
                 data_rank: int = 0, data_size: int = 1) -> None:
        per_rank, rest = divmod(global_batch_size, data_size)
        if rest or micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ConfigError(f"training.global_batch_size ({global_batch_size}) must be a multiple of "
                              f"micro_batch_size × data-parallel size ({micro_batch_size} × {data_size})")
        if not 0 <= data_rank < data_size:
            raise ValueError(f"data_rank {data_rank} is outside data_size {data_size}")
        self.samples, self.seed = samples, seed
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.data_rank, self.per_rank = data_rank, per_rank
        self.micro_per_step = per_rank // micro_batch_size
        self.micro_batches = 0  # served so far on this rank
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def consumed_samples(self) -> int:
        """Samples of complete global batches consumed, over all data-parallel ranks."""
        return self.micro_batches // self.micro_per_step * self.global_batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (the same for any seed, epoch pair on any machine)."""
        order = self._permutations.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
            # a batch spans at most two epochs: keep the current and the next
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = order
        return order

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions ``[start, start + count)``."""
        n = len(self.samples)
        positions = np.arange(start, start + count, dtype=np.int64)
        epochs, offsets = np.divmod(positions, n)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self.permutation(int(epoch))[offsets[where]]
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step, micro = divmod(self.micro_batches, self.micro_per_step)
        start = step * self.global_batch_size + self.data_rank * self.per_rank + micro * self.micro_batch_size
        self.micro_batches += 1
        # augmentation noise is a function of the stream position, like the order: resume stays exact
        noise = np.random.default_rng([self.seed, 1, start]) if self.samples.augments else None
        return self.samples.batch(self.sample_indices(start, self.micro_batch_size), noise)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size,
                "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key, mine, fix in (
                ("global_batch_size", self.global_batch_size, "keep training.global_batch_size as it was"),
                ("seed", self.seed, "keep data.seed (and training.seed) as they were"),
                ("num_samples", len(self.samples), "resume on the dataset the run started with")):
            if int(state[key]) != mine:
                raise ConfigError(f"the checkpoint's batch source had {key} {state[key]}, this run has {mine}; "
                                  f"{fix} to resume exactly")
        self.micro_batches = int(state["consumed_samples"]) // self.global_batch_size * self.micro_per_step
