"""Training checkpoints: exact resume, independent of the parallel layout that wrote them.

Layout of ``checkpoint.dir``::

    latest                      text: the name of the newest complete step directory
    iter_0000020/
      model.safetensors         the whole model: tensor/pipeline/expert shards merged into
                                full tensors under the canonical (local-spec, global-index)
                                names of trainer/model.py, float32. Loads without the
                                optimizer: this is what the Hugging Face export reads.
      optimizer.pt              AdamW state per parameter name (full tensors, like the
                                model) and the hyper-parameters
      trainer.json              step, samples and tokens seen, the batch source's position,
                                the model shape, the parallel layout and the resolved config
      rng/rank_00000.pt         each rank's RNG states: python, numpy, torch CPU (and CUDA),
                                megatron's tracker (model-/data-/expert-parallel streams)

A step directory is first written as ``iter_XXXXXXX.partial`` and renamed when
complete; ``latest`` is replaced atomically afterwards, and only then are step
directories beyond ``keep_last`` deleted. A crash mid-save therefore leaves the
previous checkpoint as ``latest``. All ranks must see the same filesystem.

Merging shards: a tensor-parallel weight is gathered along its ``partition_dim``
(SwiGLU ``linear_fc1`` halves are gathered separately, so the merged tensor is
``[gate; up]`` as with one rank); a pipeline stage's ``decoder.layers.{i}`` is
renamed to the global layer index; an expert-parallel rank's
``local_experts.{j}`` to the global expert index. Loading takes each rank's slice
of the full tensors, so a checkpoint resumes under any layout; bitwise-exact resume
additionally needs the same layout (the RNG files are per rank).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

FORMAT = "evalforge.megatron-gpt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^iter_(\d{7})$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names it and says why."""


def step_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def latest_checkpoint(directory: Path) -> Path | None:
    """The step directory ``latest`` points at, or None if there is none."""
    pointer = directory / "latest"
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    if not (path / "trainer.json").is_file():
        raise CheckpointError(f"{pointer} points at {path}, which is not a complete checkpoint; "
                              "point it at an existing iter_XXXXXXX directory or pass --resume PATH")
    return path


def resolve_resume(resume: str | None, directory: Path) -> Path | None:
    """``auto`` → the latest checkpoint (None if none yet); a path → that step directory."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(directory)
    path = Path(resume)
    if (path / "latest").is_file():
        return latest_checkpoint(path)
    if not (path / "trainer.json").is_file():
        raise CheckpointError(f"--resume {resume}: not a checkpoint (no trainer.json); pass a step directory "
                              "such as checkpoints/iter_0000100, a checkpoint directory, or 'auto'")
    return path


# --- which slice of which full tensor each local parameter is -----------------------------


@dataclass(frozen=True)
class _Shard:
    """How one local parameter relates to its full tensor."""

    name: str  # canonical global name (global layer and expert indices)
    param: torch.nn.Parameter
    tp_dim: int | None  # dimension split over tensor-parallel ranks, None if replicated
    tp_group: Any
    gated: bool  # SwiGLU fc1: its [gate; up] halves are split separately
    expert_local: int | None  # index among this rank's experts, None for a non-expert weight
    experts_per_rank: int


def _shards(model: torch.nn.Module) -> list[_Shard]:
    from megatron.core import parallel_state

    from trainer.model import canonical_name

    layers = getattr(getattr(model, "decoder", None), "layers", [])
    global_layer = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    gated_mlp = getattr(model.config, "gated_linear_unit", False)
    shards = []
    for spec_name, param in model.named_parameters():
        if getattr(param, "shared", False):
            # the last pipeline stage's copy of a tied embedding: the same full tensor
            name = "embedding.word_embeddings.weight"
        else:
            name = canonical_name(spec_name)
        match = _LAYER.match(name)
        if match:
            name = f"decoder.layers.{global_layer[int(match.group(1))]}." + name[match.end():]
        expert_local, per_rank = None, 0
        match = _EXPERT.search(name)
        if match:
            expert_local = int(match.group(1))
            experts = model.get_submodule(spec_name[: spec_name.index(".local_experts.") + len(".local_experts")])
            per_rank = len(experts)  # type: ignore[arg-type]
            name = _expert_name(name, ep_rank * per_rank + expert_local)
        group = (parallel_state.get_expert_tensor_parallel_group() if expert_local is not None
                 else parallel_state.get_tensor_model_parallel_group())
        tp_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        if tp_dim is not None and dist.get_world_size(group) == 1:
            tp_dim = None
        gated = gated_mlp and name.endswith("linear_fc1.weight")
        shards.append(_Shard(name, param, tp_dim, group, gated, expert_local, per_rank))
    return shards


def _expert_name(name: str, global_index: int) -> str:
    return _EXPERT.sub(f".mlp.experts.local_experts.{global_index}.", name, count=1)


def _gather_tp(shard: _Shard, local: Tensor) -> Tensor:
    if shard.tp_dim is None:
        return local
    size = dist.get_world_size(shard.tp_group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=shard.tp_group)
    if shard.gated:
        halves = [p.chunk(2, dim=shard.tp_dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=shard.tp_dim)
    return torch.cat(parts, dim=shard.tp_dim)


def _slice_tp(shard: _Shard, full: Tensor) -> Tensor:
    if shard.tp_dim is None:
        return full
    size, rank = dist.get_world_size(shard.tp_group), dist.get_rank(shard.tp_group)
    if shard.gated:
        gate, up = full.chunk(2, dim=shard.tp_dim)
        return torch.cat([gate.chunk(size, dim=shard.tp_dim)[rank], up.chunk(size, dim=shard.tp_dim)[rank]],
                         dim=shard.tp_dim)
    return full.chunk(size, dim=shard.tp_dim)[rank]


def _gather_full(shards: list[_Shard], local: Callable[[_Shard], Tensor]) -> dict[str, Tensor] | None:
    """Full float32 CPU tensors by canonical name on pipeline rank 0 of each pipeline, else None.

    Collective over the tensor-, expert- and pipeline-parallel groups: every rank calls it.
    """
    from megatron.core import parallel_state

    merged: dict[str, Tensor] = {}
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    for shard in shards:
        tensor = _gather_tp(shard, local(shard).detach().float())
        if shard.expert_local is not None and ep_size > 1:
            parts = [torch.empty_like(tensor) for _ in range(ep_size)]
            dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            for ep_rank, part in enumerate(parts):
                merged[_expert_name(shard.name, ep_rank * shard.experts_per_rank + shard.expert_local)] = part.cpu()
        else:
            merged.setdefault(shard.name, tensor.cpu())
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return merged
    group = parallel_state.get_pipeline_model_parallel_group()
    first = dist.get_global_rank(group, 0)
    stages: list[dict[str, Tensor] | None] = [None] * pp_size
    dist.gather_object(merged, stages if dist.get_rank() == first else None, dst=first, group=group)
    if dist.get_rank() != first:
        return None
    full: dict[str, Tensor] = {}
    for stage in stages:
        assert stage is not None
        for name, tensor in stage.items():
            full.setdefault(name, tensor)  # a tied embedding is on the first and the last stage
    return full


def _local_slice(shard: _Shard, full: dict[str, Tensor], what: str) -> Tensor:
    if shard.name not in full:
        raise CheckpointError(f"{what} has no tensor {shard.name!r}; it was written for another model")
    tensor = _slice_tp(shard, full[shard.name])
    if tensor.shape != shard.param.shape:
        raise CheckpointError(f"{what}: {shard.name} has shape {tuple(full[shard.name].shape)}, which does not "
                              f"fit this model's {tuple(shard.param.shape)} (after tensor-parallel splitting)")
    return tensor


# --- save and load --------------------------------------------------------------------------


@dataclass
class TrainState:
    """What the loop needs to continue: position and bookkeeping (model/optimizer live elsewhere)."""

    step: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    data: dict[str, Any] | None = None


def save(directory: Path, state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         metadata: dict[str, Any], keep_last: int = 0) -> Path | None:
    """Write a step directory (collective: every rank calls it); returns its path on rank 0."""
    from safetensors.torch import save_file

    shards = _shards(model)
    weights = _gather_full(shards, lambda s: s.param)
    opt_state = optimizer.state
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        moments[key] = _gather_full(shards, lambda s, key=key: opt_state[s.param][key]
                                    if s.param in opt_state else torch.zeros_like(s.param))
    steps = {s.name: float(opt_state[s.param]["step"]) for s in shards if s.param in opt_state}
    rank = dist.get_rank()
    final = directory / step_dir_name(state.step)
    partial = directory / (final.name + ".partial")
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        (partial / "rng").mkdir(parents=True)
    dist.barrier()
    torch.save(rng_state(), partial / "rng" / f"rank_{rank:05d}.pt")
    # rank 0 holds the merged tensors; AdamW's step count is the same for every parameter
    if rank == 0:
        assert weights is not None and moments["exp_avg"] is not None and moments["exp_avg_sq"] is not None
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial / "model.safetensors"),
                  metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION), "step": str(state.step)})
        step_value = max(steps.values()) if steps else 0.0
        torch.save({
            "state": {name: {"step": step_value, "exp_avg": moments["exp_avg"][name],
                             "exp_avg_sq": moments["exp_avg_sq"][name]} for name in weights},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        }, partial / "optimizer.pt")
        record = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": state.step,
                  "consumed_samples": state.consumed_samples, "tokens": state.tokens, "data": state.data,
                  "world_size": dist.get_world_size(), **metadata}
        (partial / "trainer.json").write_text(json.dumps(record, indent=2) + "\n")
    dist.barrier()
    if rank != 0:
        dist.barrier()
        return None
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    pointer = directory / "latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, directory / "latest")
    if keep_last > 0:
        for old in list_checkpoints(directory)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def read_record(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer.json").read_text())


def check_model_shape(path: Path, shape: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model shape differs from ``shape``, listing every difference."""
    saved = read_record(path).get("model_shape", {})
    diffs = [f"model.{key}: checkpoint {saved.get(key)!r}, config {value!r}"
             for key, value in shape.items() if saved.get(key) != value]
    if diffs:
        raise CheckpointError(f"cannot resume from {path}: the model shape differs from the config ("
                              + "; ".join(diffs) + "). Use the checkpoint's model settings, or start a new run "
                              "(another checkpoint.dir, or no --resume)")


def load_weights(path: Path, model: torch.nn.Module) -> list[_Shard]:
    """Copy a step directory's model weights into this rank's model (no optimizer, no RNG)."""
    from safetensors.torch import load_file

    shards = _shards(model)
    what = f"{path}/model.safetensors"
    weights = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for shard in shards:
            shard.param.copy_(_local_slice(shard, weights, what))
    return shards


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         restore_rng: bool) -> TrainState:
    """Load a step directory into this rank's model and optimizer; returns the saved position."""
    record = read_record(path)
    shards = load_weights(path, model)
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    by_param = {id(s.param): s for s in shards}
    state_dict = optimizer.state_dict()
    new_state: dict[int, dict[str, Tensor]] = {}
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            shard = by_param[id(param)]
            entry = saved["state"].get(shard.name)
            if entry is not None:
                new_state[index] = {
                    "step": torch.tensor(float(entry["step"])),
                    **{key: _local_slice(shard, {shard.name: entry[key]}, f"{path}/optimizer.pt").clone()
                       for key in ("exp_avg", "exp_avg_sq")},
                }
            index += 1
    state_dict["state"] = new_state
    for group, saved_group in zip(state_dict["param_groups"], saved["param_groups"], strict=False):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    optimizer.load_state_dict(state_dict)
    if restore_rng:
        rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if not rng_file.is_file():
            raise CheckpointError(f"{rng_file} is missing; the checkpoint was written by fewer ranks")
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    return TrainState(step=int(record["step"]), consumed_samples=int(record.get("consumed_samples", 0)),
                      tokens=int(record.get("tokens", 0)), data=record.get("data"))


# --- RNG ------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every generator this process draws from, as tensors and plain data (weights_only-loadable)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() if isinstance(v, Tensor) else v
                    for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))
