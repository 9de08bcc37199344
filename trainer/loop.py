"""The training loop every verb shares (pretrain, sft, vla): batches in, checkpoints and metrics out.

**Batch source.** The loop takes any iterator of micro-batches for *this* rank. A
micro-batch is a dict of tensors, ``b`` = ``training.micro_batch_size``, ``s`` the
sequence length:

========================  ============================  ===================================
key                       dtype, shape                  meaning
========================  ============================  ===================================
``tokens``                int64 ``[b, s]``              input token ids
``labels``                int64 ``[b, s]``              target ids (the next token), valid ids
``loss_mask``             float ``[b, s]``              1 where the target counts, 0 elsewhere
``position_ids``          int64 ``[b, s]``              RoPE positions (restart per packed doc)
``attention_mask``        bool ``[b, 1, s, s]``,        optional; True = masked out (megatron's
                          optional                      convention) and it must include the
                                                        causal part; omit it for plain causal
========================  ============================  ===================================

Each step pulls ``global_batch_size / (micro_batch_size × data-parallel size)``
micro-batches. All tensor- and pipeline-parallel ranks of one data-parallel replica
must see the same micro-batches, so build a source from the data-parallel rank only
(:class:`DataParallelShard` does it for any source that yields the global sequence).
For exact resume a source implements ``state_dict() -> dict`` (JSON-able) and
``load_state_dict(dict)``; without them the loop wraps it in :class:`ReplaySource`,
which on resume skips as many micro-batches as were consumed (exact for
deterministic sources, O(steps) to catch up).

**Objective.** The loss of a step is the mean over every ``loss_mask`` token of the
global batch (not a mean of per-micro-batch means), so gradient accumulation and
data parallelism change nothing but float rounding. Each data-parallel rank
back-propagates ``Σ(its masked token losses) · dp / global tokens`` and gradients are
averaged over data-parallel ranks, which is megatron's convention; MoE load-balancing
losses are added by megatron's router with weight ``1 / micro-batches``.

**Step.** megatron-core's ``get_forward_backward_func`` (1F1B across pipeline stages,
a plain loop over micro-batches when pipeline size is 1), then data-parallel gradient
all-reduce, global-norm clipping (tensor-parallel shards counted once), AdamW with
the schedule's LR. A non-finite loss raises :class:`NonFiniteLoss` before the update,
so nothing is saved and the last good checkpoint stays ``latest``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from trainer import checkpoint
from trainer.config import OptimizerConfig, ScheduleConfig, TrainerConfig, save_config, to_dict
from trainer.metrics import RunLogger
from trainer.parallel import Layout

Batch = dict[str, Tensor]


class BatchSource(Protocol):
    """An iterator of micro-batches (see the module docstring); state methods are optional."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; nothing was saved for this step."""

    def __init__(self, step: int, loss: float, last_checkpoint: str | None) -> None:
        self.step, self.loss, self.last_checkpoint = step, loss, last_checkpoint
        kept = (f"the last good checkpoint is {last_checkpoint} (resume with --resume auto)" if last_checkpoint
                else "no checkpoint had been written yet")
        super().__init__(f"loss is {loss} at step {step}; stopped without saving: {kept}. Lower optimizer.lr, "
                         "raise schedule.warmup_steps or check the data around this step")


class DataParallelShard:
    """This data-parallel rank's share of a source that yields the *global* micro-batch sequence.

    The global sequence is cut into steps of ``per_rank × data_size`` micro-batches;
    rank ``r`` keeps the ``r``-th block of ``per_rank`` in each, the others are drawn
    and dropped. State is the wrapped source's.
    """

    def __init__(self, source: Iterator[Batch], *, per_rank: int, data_rank: int, data_size: int) -> None:
        self.source, self.per_rank, self.data_rank, self.data_size = source, per_rank, data_rank, data_size
        self._position = 0  # micro-batches drawn from the source

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        while True:
            index = self._position
            batch = next(self.source)
            self._position += 1
            if (index % (self.per_rank * self.data_size)) // self.per_rank == self.data_rank:
                return batch

    def state_dict(self) -> dict[str, Any]:
        inner = getattr(self.source, "state_dict", None)
        return {"position": self._position, "source": inner() if callable(inner) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") is not None:
            self.source.load_state_dict(state["source"])  # type: ignore[attr-defined]
        else:
            for _ in range(int(state["position"])):
                next(self.source)
        self._position = int(state["position"])


# --- optimizer and schedule -----------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norm weights, biases) do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=betas, eps=cfg.eps)


def lr_at(step: int, optimizer: OptimizerConfig, schedule: ScheduleConfig) -> float:
    """LR for optimizer step ``step`` (1-based): linear warmup, then cosine/linear/constant decay."""
    peak, floor = optimizer.lr, schedule.min_lr
    if schedule.warmup_steps and step <= schedule.warmup_steps:
        return peak * step / schedule.warmup_steps
    if schedule.decay_style == "constant":
        return peak
    decay_steps = schedule.decay_steps or (schedule.train_steps - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps) / max(1, decay_steps))
    if schedule.decay_style == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --- one step -------------------------------------------------------------------------------


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # loss tokens in the global batch
    moe_aux_loss: float | None = None
    auxiliary_loss: float | None = None  # a vision policy's environment-state loss (trainer/vision.py), unweighted


class TrainStep:
    """Forward, backward and update for one global batch; reusable on its own (benchmarks)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, grad_clip: float) -> None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self.forward_backward = get_forward_backward_func()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device  # NCCL reduces device tensors only
        self.is_moe = getattr(model.config, "num_moe_experts", None) is not None
        self.sequence_parallel = bool(getattr(model.config, "sequence_parallel", False))

    def __call__(self, micro_batches: list[Batch], lr: float) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens = sum(mb["loss_mask"].sum() for mb in micro_batches)
        counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.dp_group)
        global_tokens = float(counts.item())
        global_tokens = max(global_tokens, 1.0) if math.isfinite(global_tokens) else global_tokens
        # per-rank objective: Σ token losses · dp / global tokens; megatron divides by the
        # number of micro-batches, and the gradient average over dp ranks undoes the · dp
        scale = len(micro_batches) * self.dp_size / global_tokens

        device = self.device

        def forward_step(data: Iterator[Batch], model: torch.nn.Module) -> tuple[Tensor, Any]:
            batch = {k: v.to(device, non_blocking=True) for k, v in next(data).items()}
            # a vision policy's batches carry their images (and maybe auxiliary targets) too:
            # trainer/vision.py's VisionGPTModel takes them
            extra = {k: batch[k] for k in ("pixel_values", "environment_state") if k in batch}
            output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                           labels=batch["labels"], **extra)
            mask = batch["loss_mask"].to(torch.float32)
            # the auxiliary loss is a per-micro-batch mean: megatron's division by the number of
            # micro-batches and the gradient average over ranks make it the global batch's mean
            auxiliary = getattr(model, "auxiliary_loss", None) if "environment_state" in batch else None

            def loss_func(per_token: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
                loss_sum = (per_token.float() * mask).sum()
                logged = {"loss_sum": loss_sum.detach()}
                if auxiliary is None:
                    return loss_sum * scale, logged
                weighted, unweighted = auxiliary
                return loss_sum * scale + weighted, logged | {"auxiliary": unweighted.detach()}

            return output, loss_func

        first = micro_batches[0]["tokens"]
        outputs = self.forward_backward(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=len(micro_batches), seq_length=first.size(1), micro_batch_size=first.size(0),
            forward_only=False,
        )
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        totals[0] = sum(float(o["loss_sum"]) for o in outputs) if outputs else 0.0
        totals[1] = self._moe_aux_loss(len(micro_batches))
        auxiliary = [float(o["auxiliary"]) for o in outputs if "auxiliary" in o]
        totals[2] = sum(auxiliary) / len(auxiliary) if auxiliary else 0.0
        dist.all_reduce(totals, group=self.dp_group)
        if self.pp_size > 1:  # only the last stage computed the loss
            from megatron.core import parallel_state

            dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
        loss = float(totals[0]) / global_tokens
        aux = float(totals[1]) / self.dp_size if self.is_moe else None
        auxiliary_loss = float(totals[2]) / self.dp_size if auxiliary else None
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(loss, float("nan"), 0, aux, auxiliary_loss)
        self._sync_grads()
        grad_norm = self._clip_grads()
        self.optimizer.step()
        return StepResult(loss, grad_norm, int(global_tokens), aux, auxiliary_loss)

    def _moe_aux_loss(self, num_micro: int) -> float:
        """Mean load-balancing loss over MoE layers and micro-batches (megatron tracks it); resets it."""
        if not self.is_moe:
            return 0.0
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if entry is None:
            return 0.0
        values = entry["values"]
        value = float(values.sum()) / max(1, int((values != 0).sum())) / num_micro
        clear_aux_losses_tracker()
        return value

    def _sync_grads(self) -> None:
        """Average gradients over data-parallel ranks, as megatron's DDP does.

        A replicated weight's gradient is summed over the data-parallel group and divided
        by its size. An expert-parallel weight has already received the gradients of the
        tokens every expert-parallel rank routed to it, so it is summed over the
        expert-data-parallel group only but still divided by the full data-parallel size.
        """
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        dense = [p for p in self.params if p.grad is not None and getattr(p, "allreduce", True)]
        expert = [p for p in self.params if p.grad is not None and not getattr(p, "allreduce", True)]
        for params, group in ((dense, self.dp_group), (expert, self.expert_dp_group)):
            if not params or self.dp_size == 1:
                continue
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat.div_(self.dp_size)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)
        if self.sequence_parallel:
            # norms (and MoE routers) see only their sequence shard under sequence parallelism:
            # their gradients are partial sums over tensor-parallel ranks
            from megatron.core import parallel_state

            grads = [p.grad for p in self.params if p.grad is not None and getattr(p, "sequence_parallel", False)]
            if grads:
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
                for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                    grad.copy_(synced)
        if self.pp_size > 1 and getattr(self.model, "share_embeddings_and_output_weights", False):
            from megatron.core import parallel_state

            weight = self.model.shared_embedding_or_output_weight()
            if weight is not None and weight.grad is not None and parallel_state.is_rank_in_embedding_group():
                dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def _clip_grads(self) -> float:
        """Global gradient norm over the whole model; scales gradients down to ``grad_clip``."""
        from megatron.core import parallel_state

        counted: dict[bool, list[Tensor]] = {False: [], True: []}  # is_expert → gradients
        for p in self.params:
            if p.grad is None or getattr(p, "shared", False):
                continue  # a pipeline stage's copy of the tied embedding is counted on the first stage
            is_expert = not getattr(p, "allreduce", True)
            tp_rank = self.etp_rank if is_expert else self.tp_rank
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:  # replicated: count once
                counted[is_expert].append(p.grad.detach())

        def squared_norm(grads: list[Tensor]) -> Tensor:
            if not grads:
                return torch.zeros(1, dtype=torch.float64, device=self.device)
            return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum().reshape(1)

        dense, expert = squared_norm(counted[False]), squared_norm(counted[True])
        if dist.get_world_size(parallel_state.get_model_parallel_group()) > 1:
            dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if any(not getattr(p, "allreduce", True) for p in self.params):
            dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        norm = math.sqrt(float(dense + expert))
        if self.grad_clip > 0 and norm > self.grad_clip:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], self.grad_clip / (norm + 1e-6))
        return norm


# --- the loop -------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What a finished (or stopped) run leaves behind."""

    step: int
    losses: dict[int, float] = field(default_factory=dict)
    last_checkpoint: str | None = None
    resumed_from: str | None = None


def train(cfg: TrainerConfig, model: torch.nn.Module, batches: BatchSource, layout: Layout,
          *, extra_metadata: dict[str, Any] | None = None) -> TrainResult:
    """Train ``model`` on ``batches`` until ``schedule.train_steps`` (or ``training.exit_at_step``).

    Resumes from ``checkpoint.resume`` when set; saves every ``checkpoint.save_every``
    steps and at the end; logs to ``cfg.log_dir``. Raises :class:`NonFiniteLoss` on a
    NaN/inf loss and ``checkpoint.CheckpointError`` for a checkpoint that does not fit.
    """
    training, schedule = cfg.training, cfg.schedule
    batches = resumable(batches)
    per_rank, rest = divmod(training.global_batch_size, training.micro_batch_size * layout.data)
    if rest or per_rank == 0:
        from trainer.config import ConfigError

        raise ConfigError(f"training.global_batch_size ({training.global_batch_size}) must be a multiple of "
                          f"training.micro_batch_size × data-parallel size ({training.micro_batch_size} × "
                          f"{layout.data})")
    optimizer = build_optimizer(model, cfg.optimizer)
    step_fn = TrainStep(model, optimizer, grad_clip=cfg.optimizer.grad_clip)
    ckpt_dir = cfg.checkpoint_dir
    metadata = {"model_shape": cfg.model.shape(), "model": to_dict(cfg.model), "config": to_dict(cfg),
                "parallel": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data,
                             "expert": layout.expert}, **(extra_metadata or {})}

    state = checkpoint.TrainState()
    result = TrainResult(step=0)
    resume_path = checkpoint.resolve_resume(cfg.checkpoint.resume, ckpt_dir)
    if resume_path is not None:
        checkpoint.check_model_shape(resume_path, cfg.model.shape())
        record = checkpoint.read_record(resume_path)
        same_layout = record.get("parallel") == metadata["parallel"]
        state = checkpoint.load(resume_path, model, optimizer, restore_rng=same_layout)
        _restore_position(batches, state)
        result.step = state.step  # a run resumed at its final step trains nothing more
        result.resumed_from = str(resume_path)
        result.last_checkpoint = str(resume_path)
    if layout.is_main:
        save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    stop_at = min(schedule.train_steps, training.exit_at_step or schedule.train_steps)
    logger = RunLogger(cfg.log_dir, total_steps=schedule.train_steps, start_step=state.step,
                       enabled=layout.is_main, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress)
    if resume_path is not None:
        note = "" if same_layout else " (another parallel layout: RNG streams restart, the rest is exact)"
        logger.message(f"resumed from {resume_path} at step {state.step}{note}")
    elif checkpoint.list_checkpoints(ckpt_dir):
        logger.message(f"note: {ckpt_dir} already holds checkpoints and this run starts from step 0 (no "
                       "checkpoint.resume); its step directories replace theirs. Pass --resume auto to continue.")
    saved_step = state.step

    def save() -> None:
        nonlocal saved_step
        state.data = _position(batches)
        saved = checkpoint.save(ckpt_dir, state, model, optimizer, metadata, keep_last=cfg.checkpoint.keep_last)
        result.last_checkpoint, saved_step = str(ckpt_dir / checkpoint.step_dir_name(state.step)), state.step
        if saved is not None:
            logger.message(f"saved {saved}")

    try:
        while state.step < stop_at:
            started = time.perf_counter()
            micro = list(itertools.islice(batches, per_rank))
            if len(micro) < per_rank:
                logger.message(f"the batch source ran out after step {state.step}; stopping there")
                break
            step = state.step + 1
            lr = lr_at(step, cfg.optimizer, schedule)
            out = step_fn(micro, lr)
            if not math.isfinite(out.loss):
                raise NonFiniteLoss(step, out.loss, result.last_checkpoint)
            elapsed = time.perf_counter() - started
            step_tokens = sum(mb["tokens"].numel() for mb in micro) * layout.data
            state.step = step
            state.consumed_samples += training.global_batch_size
            state.tokens += step_tokens
            result.step, result.losses[step] = step, out.loss
            if step % cfg.logging.log_every == 0 or step == stop_at:
                values = {"loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
                          "tokens_per_s": step_tokens / elapsed, "tokens": float(state.tokens)}
                if out.moe_aux_loss is not None:
                    values["moe_aux_loss"] = out.moe_aux_loss
                if out.auxiliary_loss is not None:
                    values["environment_state_loss"] = out.auxiliary_loss
                logger.log(step, values)
            else:
                logger.advance(step)
            every = cfg.checkpoint.save_every
            if (every and step % every == 0) or step == stop_at:
                save()
        if state.step > saved_step:  # the source ran out before the planned end
            save()
    finally:
        logger.close()
    return result


def _position(batches: BatchSource) -> dict[str, Any]:
    return batches.state_dict()  # type: ignore[attr-defined]


def _restore_position(batches: BatchSource, state: checkpoint.TrainState) -> None:
    if state.data is None:
        raise checkpoint.CheckpointError("the checkpoint records no batch-source position; it cannot be "
                                         "resumed exactly")
    batches.load_state_dict(state.data)  # type: ignore[attr-defined]


def resumable(batches: Iterator[Batch]) -> BatchSource:
    """``batches`` itself if it has state_dict/load_state_dict, else wrapped in :class:`ReplaySource`."""
    if callable(getattr(batches, "state_dict", None)) and callable(getattr(batches, "load_state_dict", None)):
        return batches
    return ReplaySource(batches)


class ReplaySource:
    """Makes any deterministic iterator resumable by counting what it yielded and replaying."""

    def __init__(self, source: Iterator[Batch]) -> None:
        self.source, self.position = source, 0

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = next(self.source)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for _ in range(int(state["position"]) - self.position):
            next(self.source)
        self.position = int(state["position"])
