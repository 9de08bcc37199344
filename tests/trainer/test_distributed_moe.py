"""MoE under expert parallelism (2 `torchrun` processes, gloo, CPU): experts split over ranks
continue a one-process run's curve, and the merged checkpoint names every global expert."""

from __future__ import annotations

import pytest

from tests.trainer.pretrain_data import prepare_data, read_losses, tiny_config
from tests.trainer.test_distributed import assert_same_curve, torchrun
from trainer.config import save_config

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from trainer.pretrain import pretrain

    root = tmp_path_factory.mktemp("moe-distributed")
    tokenizer, prefix = prepare_data(root / "data")
    moe = ["--schedule.train_steps", str(STEPS), "--model.num_experts", "4", "--model.moe_top_k", "2"]
    recipe = save_config(tiny_config(root / "unused", tokenizer, [prefix], *moe), root / "recipe.yaml")
    reference = pretrain(tiny_config(root / "one", tokenizer, [prefix], *moe))
    return root, recipe, reference.losses


def test_expert_parallel_2_continues_a_one_process_checkpoint(setup, tmp_path):
    """Each expert-parallel rank initialises only its own experts, so both start from one checkpoint."""
    from safetensors.torch import load_file

    from trainer.config import PretrainConfig, load_config
    from trainer.pretrain import pretrain

    root, recipe, reference = setup
    pretrain(load_config(PretrainConfig, recipe, ["--run_dir", str(tmp_path), "--training.exit_at_step", "2"]))
    torchrun(recipe, tmp_path, "--parallel.expert", "2", "--resume", "auto")
    assert_same_curve({s: v for s, v in read_losses(tmp_path).items() if s > 2}, reference, range(3, STEPS + 1))
    merged = load_file(str(tmp_path / f"checkpoints/iter_{STEPS:07d}/model.safetensors"))
    single = load_file(str(root / f"one/checkpoints/iter_{STEPS:07d}/model.safetensors"))
    assert sorted(merged) == sorted(single)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in merged
    for name in single:
        assert (merged[name] - single[name]).abs().max() <= 1e-5, name

