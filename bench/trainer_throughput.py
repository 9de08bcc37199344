"""Trainer throughput: `trainer pretrain`'s training step against a minimal plain-PyTorch loop.

Same process, same shape (configs/pretrain-25m.yaml: ~28 M parameters, seq 256), same
batch of token ids, AdamW with the same settings and global-norm clipping, fp32:

- **trainer (megatron-core, SDPA)** — ``trainer.loop.TrainStep`` on the ``GPTModel`` that
  ``trainer.model.build_model`` makes (megatron's local spec, our SDPA core attention),
  i.e. exactly what ``trainer pretrain`` runs per step (megatron's
  ``get_forward_backward_func``, loss masking, grad-norm, AdamW).
- **trainer (megatron's DotProductAttention)** — the same with megatron-core's own unfused
  core attention, for reference (``--no-reference-attention`` skips it).
- **plain PyTorch** — ``transformers.LlamaForCausalLM`` of the same shape with
  ``attn_implementation="sdpa"``: forward with labels, backward, ``clip_grad_norm_``,
  ``AdamW.step``.

Steps of the implementations are interleaved round by round (the machine is shared); the
median and the best step time of each are reported, and the ratios to plain PyTorch of both. Model FLOPs per token follow
``trainer.model.flops_per_token``: 6 × (matmul weights, output layer included) + 12 ×
layers × hidden × seq. MFU = tokens/s × FLOPs/token ÷ peak FLOP/s — the formula a GPU run
reports; the peak assumed is H100 SXM dense bf16, 989 TFLOP/s (``--peak-tflops``).

    .venv/bin/python bench/trainer_throughput.py [--steps 6] [--micro-batch 4] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "pretrain-25m.yaml")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per implementation")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator peak for the MFU column")
    parser.add_argument("--no-reference-attention", action="store_true",
                        help="skip the megatron DotProductAttention row")
    parser.add_argument("--quick", action="store_true", help="2 measured steps, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 2, 1

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer import parallel
    from trainer.config import ParallelConfig, PretrainConfig, load_config
    from trainer.loop import TrainStep, build_optimizer
    from trainer.model import build_model, count_parameters, flops_per_token

    cfg = load_config(PretrainConfig, args.config)
    m, seq, batch = cfg.model, cfg.model.seq_length, args.micro_batch
    parallel.initialize(ParallelConfig(), seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (batch, seq + 1), generator=generator)
    mega_batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                  "loss_mask": torch.ones(batch, seq), "position_ids": torch.arange(seq).expand(batch, seq)}

    def megatron_step(core_attention: type | None):
        model = build_model(m, core_attention=core_attention)
        step = TrainStep(model, build_optimizer(model, cfg.optimizer), grad_clip=cfg.optimizer.grad_clip)
        return lambda: step([mega_batch], cfg.optimizer.lr).loss

    hf_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.kv_heads,
        intermediate_size=m.ffn_hidden_size, max_position_embeddings=seq, rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_base, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa",
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).train()
    decay = [p for p in hf_model.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf_model.parameters() if p.dim() < 2]
    hf_opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optimizer.weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}], lr=cfg.optimizer.lr,
                               betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps)
    hf_inputs, hf_labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def plain_step() -> float:
        hf_opt.zero_grad(set_to_none=True)
        logits = hf_model(input_ids=hf_inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(), hf_labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), cfg.optimizer.grad_clip)
        hf_opt.step()
        return float(loss)

    runs = {"trainer (megatron-core, SDPA attention)": megatron_step(None), "plain PyTorch (HF Llama, SDPA)": plain_step}
    if not args.no_reference_attention:
        runs["trainer (megatron DotProductAttention)"] = megatron_step(DotProductAttention)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.warmup + args.steps):
        for name, step in runs.items():
            started = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - started
            if round_index >= args.warmup:
                times[name].append(elapsed)
            if not torch.isfinite(torch.tensor(loss)):
                raise SystemExit(f"{name}: loss {loss} is not finite")
    parallel.shutdown()

    params = count_parameters(m)
    flops = flops_per_token(m, seq)
    tokens_per_step = batch * seq
    plain_name = "plain PyTorch (HF Llama, SDPA)"
    plain_median, plain_best = statistics.median(times[plain_name]), min(times[plain_name])
    print(f"trainer throughput — {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"model: {params['total'] / 1e6:.1f} M parameters ({params['non_embedding'] / 1e6:.1f} M without "
          f"embeddings), hidden {m.hidden_size}, {m.num_layers} layers, {m.num_attention_heads} heads / "
          f"{m.kv_heads} kv, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}; batch {batch} × seq {seq} "
          f"= {tokens_per_step} tokens/step, fp32, AdamW + clipping; {args.steps} measured steps each, "
          "interleaved")
    print(f"model FLOPs/token = 6·N_matmul + 12·layers·hidden·seq = {flops / 1e6:.1f} MFLOP")
    print(f"MFU = tokens/s × FLOPs/token ÷ peak; peak assumed {args.peak_tflops:g} TFLOP/s (H100 SXM dense bf16)")
    print()
    header = (f"{'implementation':42} {'median ms':>9} {'best ms':>8} {'tokens/s':>9} {'vs plain':>9} "
              f"{'(best)':>7} {'TFLOP/s':>8} {'MFU':>9}")
    print(header)
    print("-" * len(header))
    for name, samples in times.items():
        median, best = statistics.median(samples), min(samples)
        throughput = tokens_per_step / median
        achieved = throughput * flops
        print(f"{name:42} {median * 1e3:9.0f} {best * 1e3:8.0f} {throughput:9.0f} {plain_median / median:8.2f}x "
              f"{plain_best / best:6.2f}x {achieved / 1e12:8.3f} {achieved / (args.peak_tflops * 1e12):9.2e}")

if __name__ == "__main__":
    main()
