"""Two-process `torchrun` runs (gloo, CPU): tensor, data and pipeline parallel 2 follow the
one-process loss curve, and a checkpoint written under one layout resumes under another."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.pretrain_data import free_port, prepare_data, read_losses, tiny_config
from trainer.config import save_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
TOLERANCE = 1e-5  # float summation order differs between layouts; observed differences are ~5e-7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Data, a recipe, and the one-process reference curve."""
    from trainer.pretrain import pretrain

    root = tmp_path_factory.mktemp("distributed")
    tokenizer, prefix = prepare_data(root / "data")
    recipe = save_config(tiny_config(root / "unused", tokenizer, [prefix], "--schedule.train_steps", str(STEPS)),
                         root / "recipe.yaml")
    reference = pretrain(tiny_config(root / "one", tokenizer, [prefix], "--schedule.train_steps", str(STEPS)))
    assert sorted(reference.losses) == list(range(1, STEPS + 1))
    return root, recipe, reference.losses


def torchrun(recipe: Path, run_dir: Path, *overrides: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "trainer.cli", "pretrain", "--config", str(recipe), "--run_dir", str(run_dir), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def assert_same_curve(losses: dict[int, float], reference: dict[int, float], steps: range) -> None:
    assert sorted(losses) == list(steps)
    for step in steps:
        assert abs(losses[step] - reference[step]) <= TOLERANCE, (step, losses[step], reference[step])


def test_tensor_parallel_2_matches_one_process_and_resumes_in_one(setup):
    from trainer.config import PretrainConfig, load_config
    from trainer.pretrain import pretrain

    root, recipe, reference = setup
    torchrun(recipe, root / "tp2", "--parallel.tensor", "2", "--training.exit_at_step", "6")
    assert_same_curve(read_losses(root / "tp2"), reference, range(1, 7))
    # the checkpoint holds full tensors: one process picks it up where two left off
    cfg = load_config(PretrainConfig, recipe, ["--run_dir", str(root / "tp2"), "--checkpoint.resume", "auto"])
    resumed = pretrain(cfg)
    assert resumed.resumed_from == str(root / "tp2/checkpoints/iter_0000006")
    assert_same_curve(resumed.losses, reference, range(7, STEPS + 1))


def test_data_parallel_2_matches_one_process_with_the_same_global_batch(setup):
    root, recipe, reference = setup
    # global batch 8 either way: one process accumulates 2 micro-batches of 4, two processes take one each
    torchrun(recipe, root / "dp2")
    assert_same_curve(read_losses(root / "dp2"), reference, range(1, STEPS + 1))
    record = (root / "dp2/checkpoints/iter_0000008/trainer.json").read_text()
    assert '"data": 2' in record and '"world_size": 2' in record


def test_pipeline_parallel_2_continues_a_one_process_checkpoint_exactly(setup, tmp_path):
    """Stages differ in what they initialise, so start both layouts from the same step-2 checkpoint."""
    from safetensors.torch import load_file

    from trainer.config import PretrainConfig, load_config
    from trainer.pretrain import pretrain

    root, recipe, reference = setup
    pretrain(load_config(PretrainConfig, recipe, ["--run_dir", str(tmp_path), "--training.exit_at_step", "2"]))
    torchrun(recipe, tmp_path, "--parallel.pipeline", "2", "--resume", "auto")
    assert_same_curve({s: v for s, v in read_losses(tmp_path).items() if s > 2}, reference, range(3, STEPS + 1))
    merged = load_file(str(tmp_path / "checkpoints/iter_0000008/model.safetensors"))  # both stages in one file
    single = load_file(str(root / "one/checkpoints/iter_0000008/model.safetensors"))
    assert sorted(merged) == sorted(single)
    for name in single:
        assert (merged[name] - single[name]).abs().max() <= 1e-5, name
