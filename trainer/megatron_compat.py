"""Run megatron-core 0.16.1 on CPU hosts (gloo backend) by bridging its CUDA-only calls.

megatron-core assumes a GPU in a handful of places on the training path: it asks
``torch.cuda.current_device()`` for where to put a buffer, allocates a few tensors
with a literal ``device="cuda"``, and keeps its dropout/initialisation RNG streams
in a tracker that swaps the *CUDA* generator's state. On a CPU-only torch each of
those raises "Torch not compiled with CUDA enabled".

:func:`apply` bridges exactly those calls and nothing else, and only when CUDA is
absent; on a GPU host it leaves megatron-core as shipped (but for the one TE fix
below), so NCCL runs see stock megatron-core. Two mechanisms, both scoped to megatron:

1. **Host-device view of ``torch``** for the megatron modules listed in
   ``_CUDA_DEVICE_MODULES``: their module-global name ``torch`` is replaced by a thin
   proxy that forwards every attribute to the real ``torch`` except that
   ``torch.cuda.current_device()`` answers ``cpu``, ``torch.cuda.synchronize()``
   returns at once, and tensor factories given ``device="cuda"`` allocate on the
   CPU. The real ``torch`` module, and every other importer of it, is unchanged.
   Each listed module says why it is there.
2. **CPU RNG tracker**: megatron's ``CudaRNGStatesTracker`` (used by
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()``) is
   swapped for :class:`CpuRNGStatesTracker`, which keeps the named streams
   ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng") as CPU
   generator states. On CPU the "device" generator *is* the CPU generator, so a fork
   saves it, installs the named stream, and restores it afterwards.

One more fix is not about CUDA and applies wherever TransformerEngine is missing
(GPU hosts included): ``megatron.core.transformer.moe.moe_utils`` reads the name
``te_general_gemm`` (``if te_general_gemm is not None``) but only defines it when TE
imports, so every MoE router forward without TE raises ``NameError``. :func:`apply`
defines it as ``None``, which is what the code means.

Call :func:`apply` before building a model (``trainer.parallel.initialize`` does).
Verified against megatron-core 0.16.1; other versions are refused so that a moved
CUDA call fails loudly here instead of deep inside a training step.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

SUPPORTED_MEGATRON_VERSION = "0.16.1"

# module → why it needs the host-device view of torch (only training-path calls listed)
_CUDA_DEVICE_MODULES: dict[str, str] = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "moves RoPE inv_freq to torch.cuda.current_device() on the first forward",
    "megatron.core.transformer.utils":
        "get_default_causal_mask allocates the causal mask on device='cuda'",
    "megatron.core.transformer.dot_product_attention":
        "megatron's own core attention (kept usable for comparison) allocates on the current device",
    "megatron.core.tensor_parallel.mappings":
        "tensor-parallel all-gather / reduce-scatter output buffers live on the current device",
    "megatron.core.transformer.moe.router":
        "the router moves its weight to the current device on every forward; aux-loss buffers",
    "megatron.core.transformer.moe.moe_utils":
        "the aux-loss logging tracker allocates on device='cuda'",
    "megatron.core.utils":
        "GlobalMemoryBuffer (scratch space for expert/sequence-parallel all-gathers) uses the current device",
    "megatron.core.pipeline_parallel.schedules":
        "get_forward_backward_func counts tokens in a tensor on device='cuda'",
    "megatron.core.pipeline_parallel.p2p_communication":
        "pipeline send/recv buffers live on the current device; torch.cuda.synchronize() after transfers",
}

_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint"})

_applied = False


def cuda_present() -> bool:
    """True when this process can use a CUDA device (then no bridge is needed)."""
    return torch.cuda.is_available()


class _HostCuda:
    """``torch.cuda`` as a bridged megatron module sees it: the current device is the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: object = None) -> None:
        """Nothing to wait for: CPU work (and a waited-on gloo op) is complete when it returns."""


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _HostDeviceTorch:
    """``torch`` with CUDA device requests answered by the CPU, for one megatron module."""

    cuda = _HostCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORIES:
            value = _on_host(value)
        # cache, so later lookups are plain attribute hits (this is on hot paths)
        setattr(self, name, value)
        return value


def _on_host(factory: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    call.__name__ = getattr(factory, "__name__", "factory")
    return call


class CpuRNGStatesTracker:
    """megatron's named RNG streams, kept as CPU generator states.

    Same interface as ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker``
    (it subclasses it at :func:`apply` time so megatron's ``isinstance`` checks hold).
    ``get_states``/``set_states`` return and take ``{name: ByteTensor}``, which the
    trainer's checkpoints save for exact resume.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked")
        outer = torch.get_rng_state()
        outer_name = self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
            self._current_state_name = outer_name


def _define_missing_te_names() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> bool:
    """Bridge megatron-core's CUDA-only calls when CUDA is absent; True if it did.

    Idempotent. On a host with CUDA it only defines the missing TE name (when TE is
    absent) and returns False.
    """
    global _applied
    _define_missing_te_names()
    if cuda_present():
        return False
    if _applied:
        return True
    from megatron.core import package_info

    if package_info.__version__ != SUPPORTED_MEGATRON_VERSION:
        raise RuntimeError(
            f"trainer.megatron_compat bridges megatron-core {SUPPORTED_MEGATRON_VERSION} for CPU runs, "
            f"but {package_info.__version__} is installed: install megatron-core=={SUPPORTED_MEGATRON_VERSION} "
            "or re-check the bridged calls listed in trainer/megatron_compat.py against the new version"
        )
    for module_name in _CUDA_DEVICE_MODULES:
        module = importlib.import_module(module_name)
        module.torch = _HostDeviceTorch()

    from megatron.core.tensor_parallel import random as mcore_random

    # Subclass megatron's tracker so isinstance checks in megatron (get_all_rng_states)
    # still recognise it, then make it the class megatron instantiates.
    tracker_class = type("CpuRNGStatesTracker", (CpuRNGStatesTracker, mcore_random.CudaRNGStatesTracker),
                         {"__doc__": CpuRNGStatesTracker.__doc__})
    mcore_random.CudaRNGStatesTracker = tracker_class
    # a tracker built before apply() (at import, by someone) must not survive as a CUDA one
    mcore_random.initialize_rng_tracker(force_reset=True)
    _applied = True
    return True
