"""Model provider: a megatron-core ``GPTModel`` from a :class:`~trainer.config.ModelConfig`.

``build_model`` returns a :class:`TrainerGPTModel`, a ``GPTModel`` subclass that only
swaps the loss kernel when the vocabulary is not split (see its docstring); modules,
forward signature and state dict are megatron's.

Llama-style dense decoder — RoPE, RMSNorm, SwiGLU, grouped-query attention, tied or
untied embeddings, no biases — or, with ``num_experts > 0``, the same with a MoE MLP
in every layer (top-k softmax router with the load-balancing auxiliary loss).

Layer spec: megatron-core's local spec (``get_gpt_layer_local_spec``) with the kernels
of ``trainer/kernels.py`` in the slots megatron provides — SDPA core attention, RoPE in
the fused-RoPE hook, SwiGLU as the dense MLP's activation module; the TransformerEngine
spec when TE is importable and CUDA is present (``use_te=None`` decides so). The model
never sees parallel sizes: they live in megatron's ``parallel_state`` (see
``trainer.parallel``), which the layers read.

State-dict names (the local spec, what checkpoints store and the HF export maps)::

    embedding.word_embeddings.weight                          [vocab, hidden]
    decoder.layers.{i}.input_layernorm.weight                 [hidden]
    decoder.layers.{i}.self_attention.linear_qkv.weight       [(heads + 2·kv_heads)·head_dim, hidden]
        rows grouped per KV head: for each group g, its heads/kv_heads query heads, then k_g, then v_g
    decoder.layers.{i}.self_attention.linear_proj.weight      [hidden, heads·head_dim]
    decoder.layers.{i}.pre_mlp_layernorm.weight               [hidden]
    dense:  decoder.layers.{i}.mlp.linear_fc1.weight          [2·ffn, hidden]   (gate rows, then up rows)
            decoder.layers.{i}.mlp.linear_fc2.weight          [hidden, ffn]
    MoE:    decoder.layers.{i}.mlp.router.weight              [experts, hidden]
            decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight   [2·moe_ffn, hidden]
            decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight   [hidden, moe_ffn]
    decoder.final_layernorm.weight                            [hidden]
    output_layer.weight                                       [vocab, hidden]   (absent when tied)

The TE spec fuses the norms into the next linear (``...linear_qkv.layer_norm_weight``,
``...mlp.linear_fc1.layer_norm_weight``); :func:`canonical_state_dict` renames those
to the local names above so checkpoints do not depend on which spec trained them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from trainer.config import ConfigError, ModelConfig

__all__ = ["ModelConfig", "TrainerGPTModel", "build_model", "canonical_name", "canonical_state_dict",
           "count_parameters", "flops_per_token", "layer_spec", "model_state_dict", "spec_state_dict",
           "te_available", "transformer_config"]

# TE spec name → local spec name (suffixes after "decoder.layers.{i}.")
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


class TrainerGPTModel(GPTModel):
    """megatron-core's ``GPTModel``, same modules and state dict, with a cheaper loss on one shard.

    Without tensor parallelism the vocabulary is not split, so the per-token loss is
    ``F.cross_entropy`` (one fused log-softmax/NLL kernel) instead of megatron's
    vocab-parallel cross entropy, which spends several extra passes over the
    [s, b, vocab] logits to combine shards that do not exist (about 2 % of a step on CPU).
    """

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        if self.pg_collection.tp.size() > 1 or self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)
        s, b, vocab = logits.shape
        loss = F.cross_entropy(logits.float().view(s * b, vocab), labels.t().reshape(s * b), reduction="none")
        return loss.view(s, b).t()  # [b, s], as megatron returns it


def te_available() -> bool:
    """TransformerEngine importable and a CUDA device present: the TE spec can be used."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def transformer_config(cfg: ModelConfig, *, use_te: bool = False, pipeline_size: int | None = None,
                       tensor_size: int | None = None, expert_size: int | None = None) -> TransformerConfig:
    """megatron's TransformerConfig for ``cfg``; parallel sizes default to parallel_state's."""
    from megatron.core import parallel_state

    cfg.validate()
    initialized = parallel_state.model_parallel_is_initialized()
    tp = tensor_size or (parallel_state.get_tensor_model_parallel_world_size() if initialized else 1)
    pp = pipeline_size or (parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1)
    ep = expert_size or (parallel_state.get_expert_model_parallel_world_size() if initialized else 1)
    moe = {}
    if cfg.is_moe:
        moe = dict(
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_top_k,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss",
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            # alltoall overlaps copies on CUDA streams; allgather is the one that runs on CPU
            moe_token_dispatcher_type="alltoall" if ep > 1 and torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=False,
            # top-1 routing normalises over all experts before picking one (Switch); megatron insists
            moe_router_pre_softmax=cfg.moe_top_k == 1,
        )
    fused = use_te  # the fused kernels megatron offers need CUDA (and TE/apex)
    if not use_te:
        from trainer.kernels import install_rope_kernel

        install_rope_kernel()  # our RoPE kernel in megatron's "fused RoPE" slot (see trainer/kernels.py)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.kv_heads,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_std,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # Sequence parallelism needs fused norms (TE/apex); megatron's local torch norms refuse it.
        sequence_parallel=use_te and tp > 1,
        # Full-size master weights on the CPU, then split: tensor-parallel ranks start from
        # exactly one process's weights (pipeline stages and expert-parallel ranks initialise
        # only their own layers/experts). It is also the only init path without CUDA.
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        apply_rope_fusion=True,
        gradient_accumulation_fusion=False,
        persist_layer_norm=fused,
        # the MLP takes its activation from the spec (our SwiGLU module, see layer_spec); the flag
        # is named for TE but only means "activation module from the spec"
        use_te_activation_func=not use_te and not cfg.is_moe,
        cuda_graph_scope=[],  # megatron's default "full" is its deprecated spelling of [] (and warns)
        **moe,
    )


def layer_spec(cfg: ModelConfig, *, use_te: bool = False, core_attention: type | None = None) -> ModuleSpec:
    """The transformer-layer spec: TE's on GPU hosts with TE, else the local one with our kernels.

    ``core_attention`` replaces the local spec's attention module (benchmarks compare
    megatron's own ``DotProductAttention`` this way).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = cfg.num_experts if cfg.is_moe else None
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    from trainer.kernels import SDPACoreAttention, SwiGLU

    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = core_attention or SDPACoreAttention
    if not cfg.is_moe:
        spec.submodules.mlp.submodules.activation_func = SwiGLU  # used when use_te_activation_func is on
    return spec


def build_model(cfg: ModelConfig, *, pre_process: bool | None = None, post_process: bool | None = None,
                use_te: bool | None = None, device: torch.device | None = None,
                core_attention: type | None = None, model_class: type[TrainerGPTModel] = TrainerGPTModel,
                **model_kwargs: object) -> GPTModel:
    """A ``GPTModel`` for this rank's pipeline stage (whole model when pipeline size is 1).

    megatron's parallel_state must be initialised (``trainer.parallel.initialize``).
    ``use_te=None`` picks the TransformerEngine spec when :func:`te_available`.
    ``model_class`` (a :class:`TrainerGPTModel` subclass, e.g. ``trainer.vision.VisionGPTModel``)
    is built instead, with ``model_kwargs`` added to its arguments.
    """
    from megatron.core import parallel_state

    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size is not set: set it, or give data.tokenizer_dir so the trainer can "
                          "take it from the tokenizer")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if cfg.vocab_size % tp:
        raise ConfigError(f"model.vocab_size ({cfg.vocab_size}) must be divisible by parallel.tensor ({tp}); "
                          "round it up (a multiple of 128 works for any usual tensor size)")
    for name, value in (("num_attention_heads", cfg.num_attention_heads), ("num_kv_heads", cfg.kv_heads),
                        ("ffn_hidden_size", cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size)):
        if value % tp:
            raise ConfigError(f"model.{name} ({value}) must be divisible by parallel.tensor ({tp})")
    if use_te is None:
        use_te = te_available()
    if cfg.tie_embeddings and parallel_state.get_pipeline_model_parallel_world_size() > 1 \
            and not torch.cuda.is_available():
        raise ConfigError("model.tie_embeddings with parallel.pipeline > 1 needs CUDA (megatron-core copies the "
                          "embedding to the last stage with .cuda()); untie the embeddings or use pipeline 1 on CPU")
    if cfg.is_moe and tp > 1 and not use_te:
        raise ConfigError("a MoE model with parallel.tensor > 1 needs sequence parallelism, which megatron-core's "
                          "local layer spec (torch norms, the CPU path) does not support; split experts with "
                          "parallel.expert instead, or train on a GPU host with TransformerEngine")
    config = transformer_config(cfg, use_te=use_te)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = model_class(
        config=config,
        transformer_layer_spec=layer_spec(cfg, use_te=use_te, core_attention=core_attention),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_base),
        **model_kwargs,
    )
    if device is not None:
        model.to(device)
    elif torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the whole (unsplit) model: total, and without embeddings."""
    h, v, layers = cfg.hidden_size, cfg.vocab_size or 0, cfg.num_layers
    head_dim = h // cfg.num_attention_heads
    attn = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * head_dim + cfg.num_attention_heads * head_dim * h
    if cfg.is_moe:
        ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        mlp = cfg.num_experts * 3 * h * ffn + cfg.num_experts * h
    else:
        mlp = 3 * h * cfg.ffn_hidden_size
    per_layer = attn + mlp + 2 * h
    body = layers * per_layer + h
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return {"total": body + embeddings, "non_embedding": body}


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), PaLM/Megatron style.

    6·N_active (matmul FLOPs of every weight, output layer included, embeddings'
    lookup excluded) + 12·layers·hidden·seq (attention scores and values, both
    causal halves counted, as MFU is usually reported).
    """
    h, layers = cfg.hidden_size, cfg.num_layers
    head_dim = h // cfg.num_attention_heads
    attn = h * (cfg.num_attention_heads + 2 * cfg.kv_heads) * head_dim + cfg.num_attention_heads * head_dim * h
    if cfg.is_moe:
        ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        mlp = cfg.moe_top_k * 3 * h * ffn + cfg.num_experts * h
    else:
        mlp = 3 * h * cfg.ffn_hidden_size
    active = layers * (attn + mlp) + (cfg.vocab_size or 0) * h
    return 6.0 * active + 12.0 * layers * h * seq_length


def canonical_name(key: str) -> str:
    """A state-dict key under the local spec's name (TE-fused norm names renamed)."""
    for te_name, local_name in _TE_TO_LOCAL.items():
        if key.endswith(te_name):
            return key[: -len(te_name)] + local_name
    return key


def canonical_state_dict(state: Mapping[str, object]) -> dict[str, Tensor]:
    """Tensors only, under canonical names (see the module docstring)."""
    return {canonical_name(key): value for key, value in state.items()
            if isinstance(value, Tensor) and not key.endswith("_extra_state")}


def spec_state_dict(model: GPTModel, canonical: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of :func:`canonical_state_dict` for ``model``: names as its spec has them."""
    own = set(model.state_dict())
    out: dict[str, Tensor] = {}
    for key, value in canonical.items():
        if key not in own:
            for te_name, local_name in _TE_TO_LOCAL.items():
                if key.endswith(local_name) and key[: -len(local_name)] + te_name in own:
                    key = key[: -len(local_name)] + te_name
                    break
        out[key] = value
    return out


def model_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """This rank's parameters (and persistent buffers), canonical names, detached."""
    return {k: v.detach() for k, v in canonical_state_dict(model.state_dict()).items()}

