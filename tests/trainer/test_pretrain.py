"""`trainer pretrain` on real megatron-core (CPU, gloo): the loss falls, runs leave what they promise,
MoE trains, blends follow their weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.pretrain_data import prepare_data, read_losses, tiny_config
from trainer.cli import main as trainer_main
from trainer.config import save_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain-data")
    tokenizer, prefix = prepare_data(root)
    return root, tokenizer, prefix


def test_loss_goes_down_and_the_run_directory_is_complete(data, tmp_path):
    from safetensors.torch import load_file

    root, tokenizer, prefix = data
    recipe = save_config(tiny_config(tmp_path / "unused", tokenizer, [prefix]), tmp_path / "recipe.yaml")
    run = tmp_path / "run"
    trainer_main(["pretrain", "--config", str(recipe), "--run_dir", str(run), "--checkpoint.save_every", "5",
                  "--checkpoint.keep_last", "2", "--logging.tensorboard", "true", "--model.tie_embeddings", "true"])
    from trainer.tokenizer import load_tokenizer

    vocab = -(-len(load_tokenizer(tokenizer)) // 128) * 128  # model.vocab_size null: from the tokenizer
    losses = read_losses(run)
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.5, losses
    assert losses[1] == pytest.approx(torch.log(torch.tensor(float(vocab))).item(), abs=0.5)  # near uniform

    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens", "elapsed_s"} <= set(record)
    assert record["tokens"] == 20 * 8 * 64
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "tie_embeddings: true" in (run / "config.yaml").read_text()

    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000020"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000015", "iter_0000020", "latest"]  # keep_last 2
    step_dir = ckpts / "iter_0000020"
    assert sorted(p.name for p in step_dir.iterdir()) == ["model.safetensors", "optimizer.pt", "rng", "trainer.json"]
    weights = load_file(str(step_dir / "model.safetensors"))
    assert "output_layer.weight" not in weights  # tied
    assert weights["embedding.word_embeddings.weight"].shape == (vocab, 64)
    assert weights["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert weights["decoder.layers.1.input_layernorm.weight"].shape == (64,)
    assert weights["decoder.layers.1.pre_mlp_layernorm.weight"].shape == (64,)
    assert weights["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 128, 64)
    assert weights["decoder.layers.1.mlp.linear_fc2.weight"].shape == (64, 128)
    assert weights["decoder.final_layernorm.weight"].shape == (64,)
    trainer_json = json.loads((step_dir / "trainer.json").read_text())
    assert trainer_json["step"] == 20 and trainer_json["consumed_samples"] == 160
    assert trainer_json["model"]["vocab_size"] == vocab
    assert trainer_json["model_shape"]["tie_embeddings"] is True


def test_moe_trains_with_router_and_experts(data, tmp_path):
    from safetensors.torch import load_file

    from trainer.pretrain import pretrain

    root, tokenizer, prefix = data
    cfg = tiny_config(tmp_path / "moe", tokenizer, [prefix], "--model.num_experts", "4", "--model.moe_top_k", "2",
                      "--schedule.train_steps", "12")
    result = pretrain(cfg)
    assert result.losses[12] < result.losses[1] - 1.0
    records = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.5 < r["moe_aux_loss"] < 4.0 for r in records)  # load-balancing loss, 1.0 = balanced
    weights = load_file(str(tmp_path / "moe" / "checkpoints" / "iter_0000012" / "model.safetensors"))
    assert weights["decoder.layers.0.mlp.router.weight"].shape == (4, 64)
    for j in range(4):
        assert weights[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight"].shape == (256, 64)
        assert weights[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight"].shape == (64, 128)
    assert not any(".mlp.linear_fc1" in k for k in weights)


def test_blend_follows_weights(data, tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    from trainer import parallel
    from trainer.config import ParallelConfig
    from trainer.data.gpt import build_train_dataset

    root, tokenizer, prefix = data
    _, other = prepare_data(tmp_path / "other", documents=300, seed=7, name="other", tokenizer_dir=tokenizer)
    cfg = tiny_config(tmp_path / "blend", tokenizer, [prefix, other], "--data.weights", "[0.25, 0.75]")
    parallel.initialize(ParallelConfig(), seed=0)
    try:
        dataset = build_train_dataset(cfg, num_samples=400)
    finally:
        parallel.shutdown()
    assert isinstance(dataset, BlendedDataset)
    share = (dataset.dataset_index[:400] == 1).mean()
    assert share == pytest.approx(0.75, abs=0.02)
    sample = dataset[0]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
