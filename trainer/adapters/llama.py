"""Dense models ↔ Hugging Face ``LlamaForCausalLM``.

The decoder is the same on both sides (pre-norm RMSNorm, RoPE, GQA, SwiGLU, no
biases); only names and two fused layouts differ:

==============================================  =========================================
megatron-core (canonical, ``trainer/model.py``)  Hugging Face ``LlamaForCausalLM``
==============================================  =========================================
embedding.word_embeddings.weight                 model.embed_tokens.weight
decoder.layers.{i}.input_layernorm.weight        model.layers.{i}.input_layernorm.weight
decoder.layers.{i}.self_attention.linear_qkv     model.layers.{i}.self_attn.{q,k,v}_proj
decoder.layers.{i}.self_attention.linear_proj    model.layers.{i}.self_attn.o_proj
decoder.layers.{i}.pre_mlp_layernorm.weight      model.layers.{i}.post_attention_layernorm.weight
decoder.layers.{i}.mlp.linear_fc1                model.layers.{i}.mlp.{gate,up}_proj
decoder.layers.{i}.mlp.linear_fc2                model.layers.{i}.mlp.down_proj
decoder.final_layernorm.weight                   model.norm.weight
output_layer.weight (untied only)                lm_head.weight (untied only)
==============================================  =========================================

**QKV.** megatron keeps one ``[(heads + 2·kv_heads)·head_dim, hidden]`` matrix whose
rows are grouped per key/value head: for group ``g`` the ``heads/kv_heads`` query heads
that share it, then ``k_g``, then ``v_g``. Viewed as ``[kv_heads, heads/kv_heads + 2,
head_dim, hidden]`` the first ``heads/kv_heads`` slots of every group are the query
heads in order (HF's ``repeat_kv`` also gives query head ``h`` the key/value head
``h // (heads/kv_heads)``), the last two are ``k_g`` and ``v_g``.

**RoPE.** megatron's default (``rotary_interleaved=False``) rotates halves
(``rotate_half``), like HF Llama, with the same ``inv_freq``; so unlike Meta's original
Llama weights, q/k rows need no permutation.

**SwiGLU.** ``linear_fc1`` is ``[gate; up]`` (megatron's GLU computes
``silu(x·gate) * (x·up)``), i.e. ``gate_proj`` rows then ``up_proj`` rows.

**Tied embeddings.** With ``tie_embeddings`` there is no ``output_layer.weight``; the
export sets ``tie_word_embeddings`` and writes no ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import AdapterError, StateDictAdapter
from trainer.config import ModelConfig


def split_qkv(qkv: Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """megatron's grouped ``linear_qkv`` weight → ``(q_proj, k_proj, v_proj)`` weights."""
    per_group = heads // kv_heads
    grouped = qkv.reshape(kv_heads, per_group + 2, head_dim, qkv.shape[-1])
    q = grouped[:, :per_group].reshape(heads * head_dim, -1)
    k = grouped[:, per_group].reshape(kv_heads * head_dim, -1)
    v = grouped[:, per_group + 1].reshape(kv_heads * head_dim, -1)
    # clones: views of one storage cannot be saved side by side in safetensors
    return q.clone(), k.clone(), v.clone()


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, kv_heads: int, head_dim: int) -> Tensor:
    """Inverse of :func:`split_qkv`."""
    per_group = heads // kv_heads
    hidden = q.shape[-1]
    return torch.cat([q.reshape(kv_heads, per_group, head_dim, hidden),
                      k.reshape(kv_heads, 1, head_dim, hidden),
                      v.reshape(kv_heads, 1, head_dim, hidden)], dim=1).reshape(-1, hidden)


def split_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """megatron's SwiGLU ``linear_fc1`` weight ``[gate; up]`` → ``(gate, up)``."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.clone(), up.clone()


class LlamaAdapter(StateDictAdapter):
    """Dense megatron GPTModel ↔ ``LlamaForCausalLM``; MoE families override the MLP parts."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"

    # --- shapes -------------------------------------------------------------------------------

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        assert c.vocab_size is not None  # checked in __init__
        h, hd = c.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (c.vocab_size, h)}
        for i in range(c.num_layers):
            p = f"decoder.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attention.linear_qkv.weight"] = ((c.num_attention_heads + 2 * c.kv_heads) * hd, h)
            shapes[p + "self_attention.linear_proj.weight"] = (h, c.num_attention_heads * hd)
            shapes[p + "pre_mlp_layernorm.weight"] = (h,)
            shapes.update(self._mlp_megatron_shapes(p + "mlp."))
        shapes["decoder.final_layernorm.weight"] = (h,)
        if not c.tie_embeddings:
            shapes["output_layer.weight"] = (c.vocab_size, h)
        return shapes

    def _mlp_megatron_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, ffn = self.cfg.hidden_size, self.cfg.ffn_hidden_size
        return {prefix + "linear_fc1.weight": (2 * ffn, h), prefix + "linear_fc2.weight": (h, ffn)}

    # --- megatron → HF ------------------------------------------------------------------------

    def _to_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        c = self.cfg
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
        for i in range(c.num_layers):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = split_qkv(state[src + "self_attention.linear_qkv.weight"], c.num_attention_heads,
                                c.kv_heads, self.head_dim)
            out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
            out[dst + "self_attn.q_proj.weight"] = q
            out[dst + "self_attn.k_proj.weight"] = k
            out[dst + "self_attn.v_proj.weight"] = v
            out[dst + "self_attn.o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
            out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
            out.update(self._mlp_to_hf(state, src + "mlp.", dst))
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
        if not c.tie_embeddings:
            out["lm_head.weight"] = state["output_layer.weight"]
        return out

    def _mlp_to_hf(self, state: Mapping[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
        gate, up = split_gate_up(state[src + "linear_fc1.weight"])
        return {dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                dst + "mlp.down_proj.weight": state[src + "linear_fc2.weight"]}

    # --- HF → megatron ------------------------------------------------------------------------

    def _from_hf(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        c = self.cfg
        out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"]}
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
            out[dst + "self_attention.linear_qkv.weight"] = merge_qkv(
                state[src + "self_attn.q_proj.weight"], state[src + "self_attn.k_proj.weight"],
                state[src + "self_attn.v_proj.weight"], c.num_attention_heads, c.kv_heads, self.head_dim)
            out[dst + "self_attention.linear_proj.weight"] = state[src + "self_attn.o_proj.weight"]
            out[dst + "pre_mlp_layernorm.weight"] = state[src + "post_attention_layernorm.weight"]
            out.update(self._mlp_from_hf(state, src, dst + "mlp."))
        out["decoder.final_layernorm.weight"] = state["model.norm.weight"]
        if not c.tie_embeddings:
            out["output_layer.weight"] = state["lm_head.weight"]
        return out

    def _mlp_from_hf(self, state: Mapping[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
        fc1 = torch.cat([state[src + "mlp.gate_proj.weight"], state[src + "mlp.up_proj.weight"]], dim=0)
        return {dst + "linear_fc1.weight": fc1, dst + "linear_fc2.weight": state[src + "mlp.down_proj.weight"]}

    # --- config.json ---------------------------------------------------------------------------

    def hf_config(self) -> dict[str, Any]:
        return {**self._decoder_config(), "intermediate_size": self.cfg.ffn_hidden_size,
                "attention_bias": False, "mlp_bias": False}

    def _decoder_config(self) -> dict[str, Any]:
        """Fields every Llama-like family shares."""
        c = self.cfg
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": c.seq_length,
            "rms_norm_eps": c.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(c.rope_base)},
            "tie_word_embeddings": c.tie_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": c.init_std,
            # ids are the tokenizer's business; the export fills them in when given one
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }

    @classmethod
    def model_config(cls, hf_config: Mapping[str, Any]) -> ModelConfig:
        if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
            raise AdapterError("config.json has attention_bias or mlp_bias set; the megatron model here has no "
                               "biases, so such a model cannot be converted")
        return ModelConfig(**_decoder_fields(hf_config), ffn_hidden_size=int(hf_config["intermediate_size"]))


def _decoder_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields from the parts of a Llama-like ``config.json`` all families share."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise AdapterError(f"config.json hidden_act is {act!r}; only 'silu' (SwiGLU) is supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise AdapterError(f"config.json uses RoPE scaling {rope_type!r}; only plain RoPE ('default') is supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise AdapterError(f"config.json head_dim {head_dim} × num_attention_heads {heads} ≠ hidden_size {hidden}; "
                           "the megatron model here derives head_dim as hidden_size / heads")
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": hidden,
        "num_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "seq_length": int(hf.get("max_position_embeddings", 2048)),
        "rope_base": float(theta),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
