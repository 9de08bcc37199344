"""Process-group setup: torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel_state.

One process (``trainer pretrain ...``) and ``torchrun --nproc-per-node N trainer ...``
both work: under torchrun the usual ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` variables are read; without them a one-process group
is made in memory. The parallel sizes from :class:`~trainer.config.ParallelConfig` go
to ``parallel_state.initialize_model_parallel``; the model code never sees them.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from trainer import megatron_compat
from trainer.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the parallel layout."""

    world_size: int
    rank: int
    device: torch.device
    tensor: int
    pipeline: int
    data: int
    expert: int
    tensor_rank: int
    pipeline_rank: int
    data_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes shared files."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline - 1


def initialize(parallel: ParallelConfig, seed: int, timeout_minutes: int = 30) -> Layout:
    """Start torch.distributed if needed, build megatron's groups, seed every RNG; return the layout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    megatron_compat.apply()
    use_cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if use_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    model_parallel = parallel.tensor * parallel.pipeline
    if world % model_parallel:
        raise ConfigError(f"world size {world} is not divisible by parallel.tensor × parallel.pipeline "
                          f"({parallel.tensor} × {parallel.pipeline}); launch a multiple of {model_parallel} processes")
    data = world // model_parallel
    if parallel.data is not None and parallel.data != data:
        raise ConfigError(f"parallel.data is {parallel.data} but {world} processes with tensor={parallel.tensor} and "
                          f"pipeline={parallel.pipeline} leave {data}; launch {model_parallel * parallel.data} "
                          "processes or set parallel.data to null")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        distributed_timeout_minutes=timeout_minutes,
    )
    # Every rank seeds the same: weights are initialised from full-size CPU master
    # copies and then split, so any layout starts from the same model. megatron's
    # tracker derives the per-tensor-rank stream (dropout) from this seed.
    seed_everything(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return Layout(
        world_size=world, rank=dist.get_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"),
        tensor=parallel.tensor, pipeline=parallel.pipeline, data=data, expert=parallel.expert,
        tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        data_rank=parallel_state.get_data_parallel_rank(),
    )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and, when present, CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def shutdown() -> None:
    """Tear down megatron's groups and the default process group (tests run several trainings)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
