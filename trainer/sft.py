"""`trainer sft`: supervised fine-tuning of a GPT on chat data, through the shared loop.

    trainer sft --config configs/sft-tiny.yaml [--resume auto] [--section.key VALUE ...]

Data are jsonl files in alpaca, sharegpt or OpenAI-messages form (detected per
file), rendered with a chat template (ChatML by default, or the tokenizer's own),
tokenised with loss only on assistant tokens, and packed into rows whose attention
never crosses a sample boundary — all in ``trainer/data/sft.py``. Starting weights
come from a pretraining checkpoint (``data.init_from``) or are random. The run
directory gets what every training verb writes (config.yaml, metrics.jsonl,
tensorboard/, checkpoints/), and ``--resume auto`` continues exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config import ConfigError, TrainerConfig, config_from_args

CONFIG_OVERRIDES = True


@dataclass
class SFTDataConfig:
    """Chat data for fine-tuning."""

    paths: list[str] = field(default_factory=list)
    """jsonl files (alpaca, sharegpt or OpenAI messages; the form is detected per file)."""
    tokenizer_dir: str | None = None
    """Directory of a fast tokenizer with the template's special tokens (ChatML: <|im_start|>, <|im_end|>)."""
    template: str = "chatml"
    """``chatml``, or ``tokenizer`` for the tokenizer's own chat_template."""
    truncation: str = "truncate"
    """Samples longer than a row: ``truncate`` them, or ``drop`` them."""
    init_from: str | None = None
    """A checkpoint (``checkpoints/`` dir or an ``iter_…`` dir) whose model weights start the run."""


@dataclass
class SFTConfig(TrainerConfig):
    """Everything ``trainer sft`` needs: the shared sections and chat data."""

    run_dir: str = "runs/sft"
    data: SFTDataConfig = field(default_factory=SFTDataConfig)

    def validate(self) -> None:
        super().validate()
        if not self.data.paths:
            raise ConfigError("data.paths is empty; list the jsonl files to fine-tune on")
        if self.data.tokenizer_dir is None:
            raise ConfigError("data.tokenizer_dir is not set; SFT needs the tokenizer the model was trained with")
        if self.data.template not in ("chatml", "tokenizer"):
            raise ConfigError(f"data.template must be 'chatml' or 'tokenizer', got {self.data.template!r}")
        if self.data.truncation not in ("truncate", "drop"):
            raise ConfigError(f"data.truncation must be 'truncate' or 'drop', got {self.data.truncation!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="recipe YAML (e.g. configs/sft-tiny.yaml)")
    parser.add_argument("--resume", help="'auto' (newest checkpoint in the run, if any) or a checkpoint path")
    parser.epilog = "Any config field can be overridden: --optimizer.lr 1e-4 --data.paths '[a.jsonl]' ..."


def sft(cfg: SFTConfig):  # noqa: ANN201 - returns trainer.loop.TrainResult (imported lazily)
    """Run a fine-tuning job in this process (one rank of it under torchrun)."""
    from trainer import checkpoint, parallel
    from trainer.data.sft import (
        SFTBatches,
        chat_template,
        read_conversations,
        tokenize_conversations,
    )
    from trainer.loop import DataParallelShard, train
    from trainer.model import build_model
    from trainer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer_dir)
    if cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 vocab_size=-(-len(tokenizer) // 128) * 128))
    elif cfg.model.vocab_size < len(tokenizer):
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer in "
                          f"{cfg.data.tokenizer_dir} ({len(tokenizer)} tokens)")
    template = chat_template(tokenizer, cfg.data.template)
    conversations = [c for path in cfg.data.paths for c in read_conversations(path)]
    samples = tokenize_conversations(conversations, template, seq_len=cfg.model.seq_length,
                                     truncation=cfg.data.truncation)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    layout = parallel.initialize(cfg.parallel, cfg.training.seed)
    try:
        model = build_model(cfg.model)
        if cfg.data.init_from and not cfg.checkpoint.resume:
            start = Path(cfg.data.init_from)
            step_dir = checkpoint.latest_checkpoint(start) or start
            checkpoint.check_model_shape(step_dir, cfg.model.shape())
            checkpoint.load_weights(step_dir, model)
        micro = cfg.training.micro_batch_size
        batches = DataParallelShard(
            SFTBatches(samples, seq_len=cfg.model.seq_length, batch_size=micro, seed=cfg.training.seed,
                       pad_id=pad_id),
            per_rank=cfg.training.global_batch_size // (micro * layout.data),
            data_rank=layout.data_rank, data_size=layout.data)
        return train(cfg, model, batches, layout)
    finally:
        parallel.shutdown()


def run(args: argparse.Namespace) -> object:
    from trainer.checkpoint import CheckpointError
    from trainer.data.sft import SFTDataError
    from trainer.loop import NonFiniteLoss
    from trainer.tokenizer import TokenizerError

    try:
        return sft(config_from_args(SFTConfig, args))
    except (ConfigError, CheckpointError, SFTDataError, TokenizerError, NonFiniteLoss) as exc:
        raise SystemExit(f"trainer sft: {exc}") from None
