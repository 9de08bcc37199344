"""Kernels for megatron-core's local layer spec on CPU: SDPA attention, RoPE, SwiGLU.

Each plugs into a slot megatron-core provides (a spec submodule or its "fused kernel"
hook), so the module tree, the state-dict names and the numerics stay megatron's.

**Attention.** megatron-core's local ``DotProductAttention`` materialises the full [b·heads, s, s]
score matrix with ``baddbmm``, applies an unfused masked softmax and multiplies again;
on CPU that left the trainer at about 0.6-0.8× the throughput of a plain PyTorch loop.
:class:`SDPACoreAttention` is a drop-in replacement (same constructor and forward
signature, no parameters, so state-dict names do not change) that hands the work to
PyTorch's fused SDPA kernels (flash/memory-efficient on CPU and GPU).

Masking follows megatron's convention:

* ``attention_mask is None`` and the layer is causal → ``is_causal=True``.
* an explicit ``attention_mask`` (bool, broadcastable to [b, heads, sq, sk],
  ``True`` = masked out) is used *as given*: it must already contain the causal
  part. This is how packed sequences reach the model: a block-diagonal causal mask,
  one block per packed document (``trainer.data.sft.attention_mask`` builds it). RoPE
  is relative, so a document's attention does not depend on where it sits in the row.

GQA is handled inside SDPA (``enable_gqa``), query heads sharing a key/value head
being consecutive, exactly as megatron's ``repeat_interleave`` lays them out.

**RoPE.** Without TransformerEngine megatron applies rotary embeddings unfused — per layer
and for q and k separately it recomputes cos/sin of the same frequencies and builds
the rotated half with ``torch.cat`` (forward and backward). :func:`rotary_pos_emb`
is a drop-in for the fused kernel megatron calls when ``apply_rope_fusion`` is on
(``rope_utils.fused_apply_rotary_pos_emb``, normally TE's): cos/sin are computed once
per frequency tensor and the rotation is one autograd function with an explicit
backward. :func:`install_rope_kernel` puts it in that slot when TE's is absent.

**SwiGLU.** megatron's MLP computes ``silu(a) · b`` on ``chunk(fc1(x), 2)``; autograd
then rebuilds the fc1 gradient with a ``torch.cat`` of the two halves. :class:`SwiGLU`
is the MLP's activation submodule (the spec's ``mlp.submodules.activation_func`` slot,
enabled by ``use_te_activation_func``) and writes both halves of the gradient in place,
about twice as fast on CPU. Dense MLPs only: MoE experts keep megatron's GLU.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor


class SDPACoreAttention(MegatronModule):
    """Scaled dot-product attention over megatron's [s, b, heads, dim] tensors."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not do context parallelism; use the TransformerEngine spec")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPACoreAttention supports softmax_type 'vanilla' only, not {config.softmax_type!r}")
        if config.window_size is not None:
            raise ValueError("SDPACoreAttention does not do sliding-window attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp_size)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] → context [sq, b, np·hn]."""
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes packed sequences as a block-diagonal attention_mask, "
                             "not PackedSeqParams (THD); pass attention_mask or use the TransformerEngine spec")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, h, d] → [b, h, s, d], the layout SDPA's kernels want
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        is_causal = attention_mask is None and mask_type == AttnMaskType.causal and q.size(2) > 1
        sdpa_mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_heads != self.num_kv_heads
        if dropout_p > 0.0:
            # tensor-parallel ranks hold different heads, so their dropout masks must differ
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=self.softmax_scale,
                                                         enable_gqa=gqa)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, is_causal=is_causal,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
        # [b, h, sq, d] → [sq, b, h·d]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)


class _RotateHalf(torch.autograd.Function):
    """``t·cos + rotate_half(t)·sin`` with cos/sin given for one half of the head dim."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = t.chunk(2, dim=-1)
        out = torch.empty_like(t)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        g1, g2 = grad.chunk(2, dim=-1)
        out = torch.empty_like(grad)
        d1, d2 = out.chunk(2, dim=-1)
        torch.mul(g1, cos, out=d1).addcmul_(g2, sin)
        torch.mul(g2, cos, out=d2).addcmul_(g1, sin, value=-1.0)
        return out, None, None


_cos_sin_cache: dict[str, Any] = {"freqs": None, "dtype": None, "cos": None, "sin": None}


def _cos_sin(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of the first half of ``freqs`` (megatron's are ``cat(f, f)``), once per tensor."""
    cached = _cos_sin_cache["freqs"]
    if cached is not None and cached() is freqs and _cos_sin_cache["dtype"] == dtype:
        return _cos_sin_cache["cos"], _cos_sin_cache["sin"]
    half = freqs[..., : freqs.size(-1) // 2]
    cos, sin = torch.cos(half).to(dtype), torch.sin(half).to(dtype)
    _cos_sin_cache.update(freqs=weakref.ref(freqs), dtype=dtype, cos=cos, sin=sin)
    return cos, sin


def rotary_pos_emb(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """megatron's ``fused_apply_rotary_pos_emb(t, freqs, interleaved)`` for [s, b, heads, dim] tensors."""
    from megatron.core.models.common.embeddings import rope_utils

    if interleaved or freqs.size(-1) != t.size(-1) or freqs.requires_grad:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    cos, sin = _cos_sin(freqs, t.dtype)
    return _RotateHalf.apply(t, cos, sin)


def install_rope_kernel() -> bool:
    """Make :func:`rotary_pos_emb` megatron's fused RoPE kernel unless TE provides one; True if installed."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None or rope_utils.fused_apply_rotary_pos_emb is rotary_pos_emb:
        rope_utils.fused_apply_rotary_pos_emb = rotary_pos_emb
        return True
    return False


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(a) · b`` for ``a, b = x.chunk(2, -1)``; the backward fills one gradient buffer."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        a, b = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        out = torch.empty_like(x)
        grad_a, grad_b = out.chunk(2, dim=-1)
        torch.mul(grad, F.silu(a), out=grad_b)
        grad_a.copy_(torch.ops.aten.silu_backward(grad * b, a))
        return out


class SwiGLU(torch.nn.Module):
    """SwiGLU activation module for megatron's MLP (``[..., 2·ffn]`` → ``[..., ffn]``); no parameters."""

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return _SwiGLUFunction.apply(x)
