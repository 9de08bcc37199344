"""The model provider, the SDPA core attention and the CPU bridge for megatron-core."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ModelConfig, ParallelConfig


@pytest.fixture(scope="module")
def megatron():
    from trainer import parallel

    parallel.initialize(ParallelConfig(), seed=0)
    yield
    parallel.shutdown()


def transformer_config(heads=4, kv_heads=2, hidden=64):
    from trainer.model import transformer_config as build

    return build(ModelConfig(vocab_size=128, hidden_size=hidden, num_layers=1, num_attention_heads=heads,
                             num_kv_heads=kv_heads, ffn_hidden_size=128))


@pytest.mark.parametrize("explicit_mask", [False, True], ids=["causal", "explicit-mask"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_sdpa_attention_matches_megatron_dot_product_attention(megatron, explicit_mask, kv_heads):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from trainer.data.sft import attention_mask as packed_causal_mask
    from trainer.kernels import SDPACoreAttention

    config = transformer_config(kv_heads=kv_heads)
    reference = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    sdpa = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    s, b, heads, dim = 24, 3, 4, 16
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, dim, generator=generator)
    k, v = (torch.randn(s, b, kv_heads, dim, generator=generator) for _ in range(2))
    mask = packed_causal_mask(torch.tensor([[0] * 10 + [1] * 14, [0] * 24, [0] * 5 + [1] * 5 + [2] * 14])) \
        if explicit_mask else None
    expected = reference(q, k, v, mask)
    got = sdpa(q, k, v, mask)
    assert got.shape == (s, b, heads * dim)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_packed_sequences_attend_only_within_their_document(megatron):
    """Two documents packed in one row with a block-diagonal mask give the logits each gets alone."""
    from trainer.data.sft import attention_mask as packed_causal_mask
    from trainer.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                                    num_kv_heads=2, ffn_hidden_size=128, seq_length=32)).eval()
    docs = [torch.randint(0, 128, (1, 11)), torch.randint(0, 128, (1, 21))]
    packed = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(21)]).unsqueeze(0)
    mask = packed_causal_mask(torch.tensor([[0] * 11 + [1] * 21]))
    with torch.no_grad():
        together = model(packed, positions, mask)  # [b, s, vocab] logits without labels
        alone = [model(d, torch.arange(d.size(1)).unsqueeze(0), None) for d in docs]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), atol=1e-5, rtol=1e-5)


def test_state_dict_names_are_the_documented_local_spec_names(megatron):
    from trainer.model import build_model, count_parameters, model_state_dict

    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96)
    model = build_model(cfg)
    names = model_state_dict(model)
    layer = {k.split(".", 3)[3]: tuple(v.shape) for k, v in names.items() if k.startswith("decoder.layers.0.")}
    assert layer == {
        "input_layernorm.weight": (64,),
        "self_attention.linear_qkv.weight": ((4 + 2 * 2) * 16, 64),
        "self_attention.linear_proj.weight": (64, 64),
        "pre_mlp_layernorm.weight": (64,),
        "mlp.linear_fc1.weight": (2 * 96, 64),
        "mlp.linear_fc2.weight": (64, 96),
    }
    assert {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"} <= set(names)
    assert sum(v.numel() for v in names.values()) == count_parameters(cfg)["total"]
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)["total"]


def test_te_names_map_to_local_names_and_back():
    from trainer.model import canonical_state_dict

    te = {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": torch.ones(2),
          "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": torch.ones(2),
          "decoder.layers.3.mlp.linear_fc1._extra_state": None,
          "decoder.layers.3.mlp.linear_fc1.weight": torch.ones(2)}
    assert sorted(canonical_state_dict(te)) == ["decoder.layers.3.input_layernorm.weight",
                                                "decoder.layers.3.mlp.linear_fc1.weight",
                                                "decoder.layers.3.pre_mlp_layernorm.weight"]


def test_cpu_rng_tracker_forks_a_separate_stream(megatron):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    torch.manual_seed(1)
    outside_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advanced
    model_parallel_cuda_manual_seed(5, force_reset_rng=True)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), first)  # and is reproducible from the seed


def test_bad_parallel_shapes_are_refused_with_the_fix(megatron, monkeypatch):
    from megatron.core import parallel_state

    from trainer.config import ConfigError
    from trainer.model import build_model

    with pytest.raises(ConfigError, match=r"model\.vocab_size is not set"):
        build_model(ModelConfig(vocab_size=None, hidden_size=64, num_attention_heads=4))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(129\) must be divisible by parallel\.tensor \(2\)"):
        build_model(ModelConfig(vocab_size=129, hidden_size=64, num_attention_heads=4))
    with pytest.raises(ConfigError, match=r"MoE model with parallel\.tensor > 1 needs sequence parallelism.*"
                                          r"parallel\.expert instead"):
        build_model(ModelConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_experts=4), use_te=False)


def test_flops_per_token_counts_matmuls_and_attention():
    from trainer.model import count_parameters, flops_per_token

    cfg = ModelConfig(vocab_size=4096, hidden_size=512, num_layers=8, num_attention_heads=8, num_kv_heads=4,
                      ffn_hidden_size=1408, seq_length=256)
    counts = count_parameters(cfg)
    assert counts["non_embedding"] == 8 * (512 * 1024 + 512 * 512 + 3 * 512 * 1408 + 2 * 512) + 512
    expected = 6 * (counts["non_embedding"] - 8 * 2 * 512 - 512 + 4096 * 512) + 12 * 8 * 512 * 256
    assert flops_per_token(cfg, 256) == expected


def test_rope_kernel_matches_megatron_unfused_rope_forward_and_backward():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from trainer.kernels import rotary_pos_emb

    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)(24)  # [s, 1, 1, d]
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(24, 3, 4, 16, generator=generator)
    upstream = torch.randn(24, 3, 4, 16, generator=generator)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    out_ours, out_theirs = rotary_pos_emb(ours, freqs), _apply_rotary_pos_emb_bshd(theirs, freqs)
    torch.testing.assert_close(out_ours, out_theirs, atol=1e-6, rtol=1e-6)
    (out_ours * upstream).sum().backward()
    (out_theirs * upstream).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-6)
    view = base.transpose(1, 2).contiguous().transpose(1, 2)  # megatron hands in strided views of qkv
    torch.testing.assert_close(rotary_pos_emb(view, freqs), _apply_rotary_pos_emb_bshd(view, freqs))


def test_single_shard_loss_matches_megatron_vocab_parallel_cross_entropy(megatron):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from trainer.model import build_model

    model = build_model(ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
                                    ffn_hidden_size=128, seq_length=16))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 3, 128, generator=generator, requires_grad=True)  # [s, b, vocab]
    labels = torch.randint(0, 128, (3, 16), generator=generator)  # [b, s]
    ours = model.compute_language_model_loss(labels, logits)
    theirs = vocab_parallel_cross_entropy(logits.detach().clone(), labels.t().contiguous()).t()
    assert ours.shape == (3, 16)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    mask = torch.rand(3, 16, generator=generator)
    (ours * mask).sum().backward()
    expected = torch.softmax(logits.detach(), -1)
    expected[torch.arange(16)[:, None], torch.arange(3)[None, :], labels.t()] -= 1
    torch.testing.assert_close(logits.grad, expected * mask.t()[..., None], atol=1e-5, rtol=1e-5)


def test_swiglu_kernel_matches_chunked_silu_glu():
    import torch.nn.functional as F

    from trainer.kernels import SwiGLU

    generator = torch.Generator().manual_seed(0)
    base, upstream = torch.randn(5, 3, 2 * 24, generator=generator), torch.randn(5, 3, 24, generator=generator)
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    out = SwiGLU()(ours)
    a, b = theirs.chunk(2, dim=-1)
    expected = F.silu(a) * b
    torch.testing.assert_close(out, expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)


def test_dense_mlp_uses_the_swiglu_kernel_and_moe_experts_keep_megatrons_glu(megatron):
    from trainer.kernels import SwiGLU
    from trainer.model import build_model

    dense = build_model(ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
                                    ffn_hidden_size=96))
    assert isinstance(dense.decoder.layers[0].mlp.activation_func, SwiGLU)
    moe = build_model(ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
                                  ffn_hidden_size=96, num_experts=2, moe_top_k=2))
    assert not moe.config.use_te_activation_func
