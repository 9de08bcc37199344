"""MoE models ↔ Hugging Face ``MixtralForCausalLM``.

Attention, norms and embeddings map exactly as for Llama (see
:mod:`trainer.adapters.llama`); only the MLP differs. Files use the layout of the
Mixtral checkpoints on the Hub, which both readers understand: vLLM's Mixtral loader
wants exactly these names, and transformers 5 fuses them on load (its
``conversion_mapping`` renames ``block_sparse_moe`` → ``mlp`` and stacks the experts into
``mlp.experts.gate_up_proj`` ``[E, 2·ffn, hidden]`` and ``mlp.experts.down_proj``
``[E, hidden, ffn]``)::

    megatron-core (layer i, expert j)                    Hugging Face files
    mlp.router.weight                      [E, hidden]   block_sparse_moe.gate.weight
    mlp.experts.local_experts.j.linear_fc1 [2·ffn, h]    block_sparse_moe.experts.j.w1 (gate rows)
                                                         block_sparse_moe.experts.j.w3 (up rows)
    mlp.experts.local_experts.j.linear_fc2 [h, ffn]      block_sparse_moe.experts.j.w2

Routing agrees: megatron's top-k router (score function softmax, not pre-softmax)
takes the top-k logits and softmaxes over them; Mixtral softmaxes over all experts,
takes the top k and renormalises them to sum to 1 — the same weights. Both are
dropless here (no capacity factor) and add no jitter at inference.

:meth:`MixtralAdapter.from_hf` also takes the fused in-memory layout of transformers 5
(``model.state_dict()`` of a loaded ``MixtralForCausalLM``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trainer.adapters import AdapterError
from trainer.adapters.llama import LlamaAdapter, _decoder_fields, split_gate_up
from trainer.config import ModelConfig

_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


class MixtralAdapter(LlamaAdapter):
    """MoE megatron GPTModel (SwiGLU experts, top-k softmax router) ↔ ``MixtralForCausalLM``."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"

    def __init__(self, cfg: ModelConfig) -> None:
        if not cfg.is_moe:
            raise AdapterError("MixtralAdapter needs a MoE model config (model.num_experts > 0); dense models "
                               "export as Llama (trainer.adapters.adapter_for picks the right one)")
        super().__init__(cfg)

    @property
    def expert_ffn(self) -> int:
        return self.cfg.moe_ffn_hidden_size or self.cfg.ffn_hidden_size

    def _mlp_megatron_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h, ffn = self.cfg.hidden_size, self.expert_ffn
        shapes: dict[str, tuple[int, ...]] = {prefix + "router.weight": (self.cfg.num_experts, h)}
        for j in range(self.cfg.num_experts):
            e = f"{prefix}experts.local_experts.{j}."
            shapes[e + "linear_fc1.weight"] = (2 * ffn, h)
            shapes[e + "linear_fc2.weight"] = (h, ffn)
        return shapes

    def _mlp_to_hf(self, state: Mapping[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
        moe = dst + "block_sparse_moe."
        out = {moe + "gate.weight": state[src + "router.weight"]}
        for j in range(self.cfg.num_experts):
            e = f"{src}experts.local_experts.{j}."
            gate, up = split_gate_up(state[e + "linear_fc1.weight"])
            out[f"{moe}experts.{j}.w1.weight"] = gate
            out[f"{moe}experts.{j}.w2.weight"] = state[e + "linear_fc2.weight"]
            out[f"{moe}experts.{j}.w3.weight"] = up
        return out

    def _mlp_from_hf(self, state: Mapping[str, Tensor], src: str, dst: str) -> dict[str, Tensor]:
        moe = src + "block_sparse_moe."
        out = {dst + "router.weight": state[moe + "gate.weight"]}
        for j in range(self.cfg.num_experts):
            e = f"{dst}experts.local_experts.{j}."
            out[e + "linear_fc1.weight"] = torch.cat([state[f"{moe}experts.{j}.w1.weight"],
                                                      state[f"{moe}experts.{j}.w3.weight"]], dim=0)
            out[e + "linear_fc2.weight"] = state[f"{moe}experts.{j}.w2.weight"]
        return out

    def _normalize_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """transformers 5's fused expert tensors → the per-expert file layout."""
        out: dict[str, Tensor] = {}
        for name, tensor in state.items():
            match = _FUSED.match(name)
            if match is None:
                out[name] = tensor
                continue
            moe, kind = match.group(1) + "block_sparse_moe.", match.group(2)
            if kind == "gate.weight":
                out[moe + "gate.weight"] = tensor
            elif kind == "experts.gate_up_proj":  # [E, 2·ffn, hidden], gate rows first
                for j, fused in enumerate(tensor):
                    gate, up = fused.chunk(2, dim=0)
                    out[f"{moe}experts.{j}.w1.weight"], out[f"{moe}experts.{j}.w3.weight"] = gate, up
            else:  # experts.down_proj [E, hidden, ffn]
                for j, down in enumerate(tensor):
                    out[f"{moe}experts.{j}.w2.weight"] = down
        return out

    def hf_config(self) -> dict[str, Any]:
        c = self.cfg
        return {**self._decoder_config(),
                "intermediate_size": self.expert_ffn,
                "num_local_experts": c.num_experts,
                "num_experts_per_tok": c.moe_top_k,
                "router_aux_loss_coef": c.moe_aux_loss_coeff,
                "router_jitter_noise": 0.0,
                "output_router_logits": False,
                "sliding_window": None}

    @classmethod
    def model_config(cls, hf_config: Mapping[str, Any]) -> ModelConfig:
        if hf_config.get("sliding_window"):
            raise AdapterError(f"config.json sets sliding_window {hf_config['sliding_window']}; the megatron model "
                               "here attends to the whole sequence, so set it to null")
        ffn = int(hf_config["intermediate_size"])
        return ModelConfig(**_decoder_fields(hf_config), ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
                           num_experts=int(hf_config["num_local_experts"]),
                           moe_top_k=int(hf_config.get("num_experts_per_tok", 2)),
                           moe_aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", 0.01)))
