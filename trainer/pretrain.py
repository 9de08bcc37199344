"""`trainer pretrain`: pretrain a Llama-style (or MoE) GPT on megatron-core from indexed datasets.

    trainer pretrain --config configs/pretrain-tiny.yaml [--resume auto] [--section.key VALUE ...]
    torchrun --nproc-per-node 2 -m trainer.cli pretrain --config ... --parallel.tensor 2

The recipe's sections are described in ``trainer/config.py``; any field can be
overridden on the command line (``--optimizer.lr 1e-3``). Data are the ``.bin``/``.idx``
prefixes written by ``trainer preprocess``, blended by ``data.weights``. The run
directory (``run_dir``) receives ``config.yaml`` (the resolved config),
``metrics.jsonl``, ``tensorboard/`` and ``checkpoints/``; ``--resume auto`` continues
from the newest checkpoint there, exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from trainer.config import ConfigError, PretrainConfig, config_from_args

# this verb takes `--section.key value` overrides after its own options
CONFIG_OVERRIDES = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="recipe YAML (e.g. configs/pretrain-tiny.yaml)")
    parser.add_argument("--resume", help="'auto' (newest checkpoint in the run, if any) or a checkpoint path")
    parser.epilog = "Any config field can be overridden: --optimizer.lr 3e-4 --parallel.tensor 2 ..."


def resolve_vocab(cfg: PretrainConfig) -> PretrainConfig:
    """Fill ``model.vocab_size`` from the tokenizer (rounded up to 128) when the recipe leaves it null."""
    from trainer.data.gpt import DatasetTokenizer

    if cfg.data.tokenizer_dir is None:
        if cfg.model.vocab_size is None:
            raise ConfigError("model.vocab_size is null and data.tokenizer_dir is not set; set one of them")
        return cfg
    tokenizer_size = DatasetTokenizer(cfg.data.tokenizer_dir).vocab_size
    if cfg.model.vocab_size is None:
        model = dataclasses.replace(cfg.model, vocab_size=-(-tokenizer_size // 128) * 128)
        return dataclasses.replace(cfg, model=model)
    if cfg.model.vocab_size < tokenizer_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer in "
                          f"{cfg.data.tokenizer_dir} ({tokenizer_size} tokens); raise it or set it to null")
    return cfg


def pretrain(cfg: PretrainConfig):  # noqa: ANN201 - returns trainer.loop.TrainResult (imported lazily)
    """Run a pretraining job in this process (one rank of it under torchrun)."""
    from trainer import parallel
    from trainer.data.gpt import GPTBatches, build_train_dataset, check_dataset_paths
    from trainer.loop import train
    from trainer.model import build_model

    check_dataset_paths(cfg.data.paths)
    cfg = resolve_vocab(cfg)
    layout = parallel.initialize(cfg.parallel, cfg.training.seed)
    try:
        model = build_model(cfg.model)
        dataset = build_train_dataset(cfg, cfg.schedule.train_steps * cfg.training.global_batch_size)
        batches = GPTBatches(dataset, micro_batch_size=cfg.training.micro_batch_size,
                             global_batch_size=cfg.training.global_batch_size,
                             data_rank=layout.data_rank, data_size=layout.data)
        return train(cfg, model, batches, layout)
    finally:
        parallel.shutdown()


def run(args: argparse.Namespace) -> object:
    from trainer.checkpoint import CheckpointError
    from trainer.data.corpus import CorpusError
    from trainer.loop import NonFiniteLoss
    from trainer.tokenizer import TokenizerError

    try:
        return pretrain(config_from_args(PretrainConfig, args))
    except (ConfigError, CheckpointError, CorpusError, TokenizerError, NonFiniteLoss) as exc:
        raise SystemExit(f"trainer pretrain: {exc}") from None
