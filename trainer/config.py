"""Training configuration: one dataclass per concern, loaded from YAML with dotted overrides.

A recipe (``configs/*.yaml``) has one mapping per section::

    model: {hidden_size: 512, num_layers: 8, ...}
    optimizer: {lr: 3.0e-4}

Anything not given takes the dataclass default. On the command line any field can
be overridden with its dotted name: ``--optimizer.lr 3e-4 --parallel.tensor 2``
(values are parsed as YAML, then checked against the field's type). Unknown keys
and values of the wrong type are refused with the key, the expected type and the
fix. The resolved config (defaults, recipe and overrides together) is written to
``config.yaml`` in every run directory, so a run can be repeated from that file alone.

:func:`load_config` works for any dataclass built from these pieces, so other verbs
(``trainer sft``, ``trainer vla``) define their own top-level dataclass and reuse it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the fix."""


@dataclass
class ModelConfig:
    """A Llama-style decoder (RoPE, RMSNorm, SwiGLU, GQA); a MoE one when ``num_experts > 0``."""

    vocab_size: int | None = None
    """Embedding rows. ``null``: the tokenizer's size rounded up to a multiple of 128."""
    hidden_size: int = 512
    num_layers: int = 8
    num_attention_heads: int = 8
    num_kv_heads: int | None = None
    """Key/value heads (GQA). ``null``: as many as attention heads (plain multi-head)."""
    ffn_hidden_size: int = 1408
    """SwiGLU inner size (per expert for MoE unless ``moe_ffn_hidden_size`` is set)."""
    seq_length: int = 256
    """Longest sequence the model is trained on."""
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    num_experts: int = 0
    """0: dense MLP in every layer; > 0: a MoE layer with this many experts in every layer."""
    moe_top_k: int = 2
    moe_aux_loss_coeff: float = 0.01
    """Weight of the load-balancing auxiliary loss (Switch-style)."""
    moe_ffn_hidden_size: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) must be a multiple of "
                              f"model.num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"model.num_kv_heads ({self.kv_heads})")
        if self.num_experts < 0 or (self.is_moe and not 1 <= self.moe_top_k <= self.num_experts):
            raise ConfigError(f"model.moe_top_k ({self.moe_top_k}) must be between 1 and model.num_experts "
                              f"({self.num_experts})")

    def shape(self) -> dict[str, Any]:
        """The fields that decide parameter shapes (what a checkpoint must agree with)."""
        return {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads, "num_kv_heads": self.kv_heads,
            "ffn_hidden_size": self.ffn_hidden_size, "tie_embeddings": self.tie_embeddings,
            "num_experts": self.num_experts,
            "moe_ffn_hidden_size": (self.moe_ffn_hidden_size or self.ffn_hidden_size) if self.is_moe else None,
        }


@dataclass
class DataConfig:
    """Pretraining data: Megatron indexed datasets (``.bin``/``.idx`` pairs), blended by weight."""

    paths: list[str] = field(default_factory=list)
    """Dataset prefixes (the path without ``.bin``/``.idx``), as ``trainer preprocess`` wrote them."""
    weights: list[float] | None = None
    """Sampling weight per path (normalised to sum 1); ``null``: equal weights."""
    tokenizer_dir: str | None = None
    """Directory written by ``trainer tokenizer`` (any ``PreTrainedTokenizerFast`` directory works)."""
    seq_length: int | None = None
    """Tokens per training sample; ``null``: ``model.seq_length``."""
    split: str = "100,0,0"
    """Train/valid/test split of each dataset, Megatron style ("98,2,0")."""
    cache_dir: str | None = None
    """Where GPTDataset keeps its sample indices; ``null``: ``<run_dir>/data_cache``."""


@dataclass
class TrainingConfig:
    """Batch sizes and the seed."""

    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all data-parallel ranks (the rest is gradient accumulation)."""
    seed: int = 1234
    exit_at_step: int | None = None
    """Stop at this step (after saving a checkpoint) though ``schedule.train_steps`` is later:
    for jobs with a time limit; ``--resume auto`` continues exactly."""


@dataclass
class OptimizerConfig:
    """AdamW with decoupled weight decay and global-norm gradient clipping."""

    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Applied to matrices only; norms and biases are not decayed."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 turns clipping off."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then decay to ``min_lr``."""

    train_steps: int = 1000
    warmup_steps: int = 0
    decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = 0.0
    decay_steps: int | None = None
    """Steps over which the LR decays after warmup; ``null``: until ``train_steps``."""


@dataclass
class ParallelConfig:
    """Parallel layout, handed to megatron-core's ``parallel_state.initialize_model_parallel``."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    data: int | None = None
    """Data-parallel size; ``null``: whatever the world size leaves (world / (tensor · pipeline))."""


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written (layout: see ``trainer/checkpoint.py``)."""

    dir: str | None = None
    """``null``: ``<run_dir>/checkpoints``."""
    save_every: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 3
    """Keep the newest K step directories (0: keep all)."""
    resume: str | None = None
    """``auto`` (latest in ``dir``, if any), a step directory, or ``null`` (start fresh)."""


@dataclass
class LoggingConfig:
    """Progress bar, ``metrics.jsonl`` and TensorBoard scalars."""

    dir: str | None = None
    """``null``: the run directory."""
    log_every: int = 1
    tensorboard: bool = True
    progress: bool = True
    """Show a rich progress bar (rank 0, when stdout is a terminal or forced)."""


@dataclass
class TrainerConfig:
    """The sections every training verb shares; a verb's config adds its own ``data`` section.

    ``trainer.loop.train`` reads only these, so ``trainer sft`` and ``trainer vla``
    subclass this with their data section and reuse the loop, checkpoints and logging.
    """

    run_dir: str = "runs/pretrain"
    """Everything a run writes goes here: config.yaml, metrics.jsonl, tensorboard/, checkpoints/."""
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run_dir) / "checkpoints"

    @property
    def log_dir(self) -> Path:
        return Path(self.logging.dir) if self.logging.dir else Path(self.run_dir)

    @property
    def seq_length(self) -> int:
        return self.model.seq_length

    def validate(self) -> None:
        self.model.validate()
        if self.training.global_batch_size % self.training.micro_batch_size:
            raise ConfigError(f"training.global_batch_size ({self.training.global_batch_size}) must be a "
                              f"multiple of training.micro_batch_size ({self.training.micro_batch_size})")
        if self.schedule.warmup_steps > self.schedule.train_steps:
            raise ConfigError(f"schedule.warmup_steps ({self.schedule.warmup_steps}) exceeds "
                              f"schedule.train_steps ({self.schedule.train_steps})")
        if len(self.optimizer.betas) != 2:
            raise ConfigError(f"optimizer.betas must be two numbers, got {self.optimizer.betas}")
        if self.schedule.train_steps < 1:
            raise ConfigError(f"schedule.train_steps must be at least 1, got {self.schedule.train_steps}")


@dataclass
class PretrainConfig(TrainerConfig):
    """Everything ``trainer pretrain`` needs: the shared sections and indexed-dataset data."""

    data: DataConfig = field(default_factory=DataConfig)

    @property
    def seq_length(self) -> int:
        return self.data.seq_length or self.model.seq_length

    def validate(self) -> None:
        super().validate()
        if self.seq_length > self.model.seq_length:
            raise ConfigError(f"data.seq_length ({self.seq_length}) is longer than model.seq_length "
                              f"({self.model.seq_length}); lower data.seq_length or raise model.seq_length")
        if self.data.weights is not None and len(self.data.weights) != len(self.data.paths):
            raise ConfigError(f"data.weights has {len(self.data.weights)} values for {len(self.data.paths)} "
                              "data.paths; give one weight per path, or null for equal weights")


C = TypeVar("C")


def config_from_args(cls: type[C], args: Any) -> C:
    """A training verb's config from its ``--config``, ``--resume`` and ``--section.key value`` arguments."""
    overrides = list(args.overrides or [])
    if args.resume:
        overrides += ["--checkpoint.resume", args.resume]
    return load_config(cls, args.config, overrides)


def load_config(cls: type[C], path: Path | str | None = None, overrides: list[str] | None = None) -> C:
    """Build ``cls`` from its defaults, a YAML recipe and ``--dotted.key value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass a recipe from configs/ or a path to one")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections, got {type(raw).__name__}")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value)
    config = _build(cls, raw, prefix="")
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    return config


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``["--optimizer.lr", "3e-4", "--model.tie_embeddings=true"]`` → ``[(key, value), ...]``."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        key, eq, text = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value; write --{key} VALUE")
            text = args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        pairs.append((key, value))
    return pairs


def to_dict(config: object) -> dict[str, Any]:
    """The config as plain data (what ``config.yaml`` holds)."""
    return dataclasses.asdict(config)  # type: ignore[call-overload]


def save_config(config: object, path: Path) -> Path:
    """Write the resolved config as YAML (sections in declaration order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override --{key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type[C], raw: dict[str, Any], prefix: str) -> C:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            section = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"config key {where!r} is unknown{hint} (known in {section}: {', '.join(fields)})")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"config key {where!r} is a section and expects a mapping, got {value!r}")
            kwargs[key] = _build(annotation, value, prefix=f"{where}.")
        else:
            kwargs[key] = _coerce(value, annotation, where)
    return cls(**kwargs)


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """``value`` as ``annotation`` wants it, or a ConfigError naming the key and the type."""
    def wrong() -> ConfigError:
        return ConfigError(f"config key {where!r} expects {_type_name(annotation)}, "
                           f"got {value!r} ({type(value).__name__})")

    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None:
            if type(None) in options:
                return None
            raise wrong()
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise wrong()
    if origin is Literal:
        if value in typing.get_args(annotation):
            return value
        raise wrong()
    if origin is list:
        if not isinstance(value, list):
            raise wrong()
        (item_type,) = typing.get_args(annotation)
        return [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise wrong()
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong()
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "3e-4" (no dot) as a string; accept numbers written that way
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise wrong() from None
        raise wrong()
    if annotation is str:
        if isinstance(value, str):
            return value
        raise wrong()
    raise ConfigError(f"config key {where!r} has a type the loader does not know: {annotation!r}")
