"""Pretraining batches from Megatron indexed datasets: ``GPTDataset`` blended by weight.

``build_train_dataset`` hands the ``data`` section of a recipe to megatron-core's
``BlendedMegatronDatasetBuilder``: each prefix in ``data.paths`` becomes a
``GPTDataset`` (fixed-length samples cut across document boundaries, shuffled with
the run's seed), several become a ``BlendedDataset`` drawing from each in proportion
to ``data.weights``. Sample indices are cached under ``data.cache_dir`` (rank 0
builds them, the others load them).

:class:`GPTBatches` turns that dataset into the trainer's batch source (see
``trainer/loop.py``): global batch ``g`` is samples ``[g·G, (g+1)·G)``; data-parallel
rank ``r`` takes the ``r``-th contiguous slice of it, in micro-batches. Its position
is one integer (samples consumed), so resuming is exact and O(1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, PretrainConfig


class DatasetTokenizer:
    """What GPTDataset needs of a tokenizer (end-of-document and pad ids), from a HF one."""

    def __init__(self, directory: Path | str) -> None:
        from trainer.tokenizer import end_of_document_id, load_tokenizer

        tokenizer = load_tokenizer(directory)
        self.vocab_size = len(tokenizer)
        self.eod = end_of_document_id(tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1
        # part of the hash that names GPTDataset's cached indices
        self.unique_identifiers = {"class": "DatasetTokenizer", "path": str(Path(directory).resolve()),
                                   "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


def check_dataset_paths(paths: list[str]) -> None:
    """Every prefix has its .bin and .idx, or a ConfigError naming the missing file."""
    if not paths:
        raise ConfigError("data.paths is empty; preprocess a corpus with `trainer preprocess` and list the "
                          "output prefix in data.paths")
    for prefix in paths:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise ConfigError(f"dataset {prefix}{suffix} does not exist (data.paths entry {prefix!r}); "
                                  "write it with `trainer preprocess --out PREFIX` or fix the path")


def build_train_dataset(cfg: PretrainConfig, num_samples: int) -> Any:
    """The train split of the blend in ``cfg.data``, with at least ``num_samples`` samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    data = cfg.data
    check_dataset_paths(data.paths)
    if data.tokenizer_dir is None:
        raise ConfigError("data.tokenizer_dir is not set; point it at the tokenizer the data was preprocessed with")
    weights = data.weights
    if weights is None and len(data.paths) > 1:
        # without weights megatron builds a single pass over each dataset, however long the run
        weights = [1.0] * len(data.paths)
    cache = Path(data.cache_dir) if data.cache_dir else Path(cfg.run_dir) / "data_cache"
    config = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.seq_length,
        blend=(list(data.paths), weights),
        split=data.split,
        path_to_cache=str(cache),
        tokenizer=DatasetTokenizer(data.tokenizer_dir),  # type: ignore[arg-type]
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # causal masking happens inside attention; a [s, s] mask per sample would only cost memory
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True,
                                                config).build()
    if train is None or len(train) < num_samples:
        raise ConfigError(f"the train split of {data.paths} gives {0 if train is None else len(train)} samples, "
                          f"fewer than the {num_samples} the run needs; check data.split")
    return train


class GPTBatches:
    """This data-parallel rank's micro-batches of a map-style dataset, in global-batch order."""

    def __init__(self, dataset: Any, *, micro_batch_size: int, global_batch_size: int, data_rank: int = 0,
                 data_size: int = 1) -> None:
        per_rank, rest = divmod(global_batch_size, data_size)
        if rest or per_rank % micro_batch_size:
            raise ConfigError(f"training.global_batch_size ({global_batch_size}) must be a multiple of "
                              f"micro_batch_size × data-parallel size ({micro_batch_size} × {data_size})")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.data_rank = data_rank
        self.micro_per_step = per_rank // micro_batch_size
        self.micro_batches = 0  # served so far on this rank

    @property
    def consumed_samples(self) -> int:
        """Samples of complete global batches consumed (over all data-parallel ranks)."""
        return self.micro_batches // self.micro_per_step * self.global_batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step, micro = divmod(self.micro_batches, self.micro_per_step)
        start = (step * self.global_batch_size + self.data_rank * self.micro_per_step * self.micro_batch_size
                 + micro * self.micro_batch_size)
        if start + self.micro_batch_size > len(self.dataset):
            raise StopIteration
        samples = [self.dataset[i] for i in range(start, start + self.micro_batch_size)]
        self.micro_batches += 1
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed, gbs = int(state["consumed_samples"]), int(state["global_batch_size"])
        if gbs != self.global_batch_size:
            raise ConfigError(f"the checkpoint was trained with training.global_batch_size {gbs}, the config "
                              f"says {self.global_batch_size}; keep it equal to resume exactly")
        self.micro_batches = consumed // self.global_batch_size * self.micro_per_step
