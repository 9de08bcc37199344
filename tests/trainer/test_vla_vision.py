"""`trainer vla` with a vision section, on a tiny MetaWorld reach-pixels dataset with corner frames.

The frames a batch carries are ``policy_format.pixel_values`` of the recorded frames (the server's
preprocessing); a few steps train the encoder with the decoder; the export holds both weight files,
which the policy server's own loader and the hf engine serve; the export refuses a vision checkpoint
without its card.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from policy_format import load_checkpoint, pixel_values
from services.protocol.client import PolicyClient
from tests.policy_server.conftest import start_server
from trainer.cli import main as trainer_main
from trainer.data.lerobot import DatasetError, DemonstrationDataset
from trainer.data.robot import RobotSamples, dataset_card

SUITE = "metaworld-mt1-reach-pixels"
SIZE = 32


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vla-vision") / "reach-pixels-2"
    trainer_main(["collect-demos", "--suite", SUITE, "--episodes-per-task", "2", "--out", str(out), "--workers", "1",
                  "--cameras", "corner", "--image-size", "48"])  # recorded at 48, trained at 32: resized
    return out


def _recipe(tmp_path: Path, dataset_dir: Path, **vision: object) -> Path:
    raw = {
        "run_dir": str(tmp_path / "run"),
        "data": {"path": str(dataset_dir), "chunk_size": 4, "state_bins": 32, "action_bins": 32},
        "vision": {"cameras": "corner", "image_size": SIZE, "patch_size": 8, "hidden_size": 32, "num_layers": 1,
                   "num_attention_heads": 1, "shift": 2, **vision},
        "model": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 2, "ffn_hidden_size": 128},
        "training": {"micro_batch_size": 4, "global_batch_size": 8, "seed": 0},
        "optimizer": {"lr": 1e-3},
        "schedule": {"train_steps": 3, "warmup_steps": 1},
        "logging": {"tensorboard": False, "progress": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_batches_carry_the_servers_preprocessing_of_the_recorded_frames(dataset_dir):
    from trainer.vision import CameraImages
    from trainer.vla import VisionConfig, vision_inputs

    dataset = DemonstrationDataset(dataset_dir)
    card = dataset_card(dataset, name="t", chunk_size=4)
    card.cameras, card.vision = vision_inputs(VisionConfig(cameras="corner", image_size=SIZE, patch_size=8,
                                                           hidden_size=32, num_layers=1, num_attention_heads=1))
    images = CameraImages(dataset, card.cameras)
    samples = RobotSamples(dataset, card.tokenizer(), images=images)
    batch = samples.batch(np.array([0, 5]))
    frame = dataset.frames(0, "corner")[5]
    assert frame.shape == (48, 48, 3) and batch["pixel_values"].shape == (2, 1, 3, SIZE, SIZE)
    np.testing.assert_array_equal(batch["pixel_values"][1].numpy(), pixel_values({"corner": frame}, card.cameras))
    assert batch["tokens"].shape[1] == card.tokenizer().seq_length == 1 + 16 + 36 + 16
    assert (batch["tokens"][:, 1:17] == 0).all() and (batch["loss_mask"][:, :16 + 36] == 0).all()
    # augmentation shifts by at most 2 pixels: a different, but nearby, picture
    shifted = CameraImages(dataset, card.cameras, shift=2).pixel_values(np.array([5]), np.random.default_rng(1))
    assert shifted.shape == (1, 1, 3, SIZE, SIZE)
    assert CameraImages(dataset, card.cameras, blank=True).pixel_values(np.array([5])).eq(-1.0).all()


def test_a_vision_run_exports_both_weight_files_and_the_server_serves_them(dataset_dir, tmp_path):
    from safetensors.torch import load_file

    from services.policy_server.vision import load_vision_tower

    assert trainer_main(["vla", "--config", str(_recipe(tmp_path, dataset_dir))]) == 0
    policy = tmp_path / "run" / "policy"
    ckpt = load_checkpoint(policy)
    assert ckpt.card.vision is not None and ckpt.card.image_len == 16
    assert ckpt.card.provenance["image_augmentation"] == {"shift": 2, "color_jitter": 0.0}
    vision = load_file(str(policy / "vision.safetensors"))
    assert all(k.startswith(("vision_model.", "multi_modal_projector.")) for k in vision)
    assert not any(k.startswith("vision") for k in load_file(str(policy / "model.safetensors")))
    # the exported file is the trained encoder and projector, under the file's names
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "iter_0000003" / "model.safetensors"))
    assert torch.equal(trained["vision.multi_modal_projector.linear_2.weight"],
                       vision["multi_modal_projector.linear_2.weight"])
    tower = load_vision_tower(ckpt)
    rows = tower(torch.zeros(1, 3, SIZE, SIZE))
    assert rows.shape == (1, 16, 64)
    server = start_server(policy, tmp_path, "--engine", "hf")
    try:
        with PolicyClient(server.ws_url) as client:
            assert client.metadata.cameras == {"corner": (SIZE, SIZE)}
            frame = np.zeros((SIZE, SIZE, 3), np.uint8)
            reply = client.infer({"state": np.zeros(36, np.float32), "task": "reach-v3", "images": {"corner": frame}})
            assert reply.actions.shape == (4, 4)
    finally:
        server.stop()


def test_the_export_of_a_vision_checkpoint_needs_its_card(dataset_dir, tmp_path):
    assert trainer_main(["vla", "--config", str(_recipe(tmp_path, dataset_dir)), "--policy.export", "false"]) == 0
    with pytest.raises(SystemExit, match="holds a vision encoder .* pass --policy-json"):
        trainer_main(["export", str(tmp_path / "run" / "checkpoints"), "--out", str(tmp_path / "out")])
    state_only = json.loads((tmp_path / "run" / "policy.json").read_text())
    del state_only["vision"]
    (tmp_path / "card.json").write_text(json.dumps(state_only))
    with pytest.raises(SystemExit, match="has no vision section"):
        trainer_main(["export", str(tmp_path / "run" / "checkpoints"), "--out", str(tmp_path / "out"),
                      "--policy-json", str(tmp_path / "card.json")])


def test_the_pixel_demos_record_the_hidden_goal(dataset_dir):
    from benchmarks.registry import get_suite

    dataset = DemonstrationDataset(dataset_dir)
    assert dataset.info["features"]["observation.environment_state"]["names"] == ["goal_x", "goal_y", "goal_z"]
    with get_suite(SUITE).make_env("reach-v3", 0) as env:
        for ep in dataset:
            env.reset(ep.seed)
            goal = env.expert_observation()["state"][36:39]
            assert ep.environment_state.shape == (ep.length, 3)
            np.testing.assert_allclose(ep.environment_state, np.broadcast_to(goal, (ep.length, 3)), atol=1e-6)
        assert env.hidden_state()[0] == ("goal_x", "goal_y", "goal_z")
    with get_suite("metaworld-mt1-reach").make_env("reach-v3", 0) as env:
        env.reset()
        assert env.hidden_state() is None  # the state suite hides nothing


def test_the_environment_state_loss_trains_a_head_that_the_export_leaves_out(dataset_dir, tmp_path):
    from safetensors.torch import load_file

    recipe = _recipe(tmp_path, dataset_dir, environment_state_loss=1.0)
    assert trainer_main(["vla", "--config", str(recipe), "--schedule.train_steps", "40", "--optimizer.lr", "3e-3",
                         "--logging.log_every", "1"]) == 0
    run = tmp_path / "run"
    logged = [json.loads(line).get("environment_state_loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert None not in logged and len(logged) == 40
    # the heads learn the two episodes' goals from their images
    assert np.mean(logged[-5:]) < 0.5 * np.mean(logged[:5])
    trained = load_file(str(run / "checkpoints" / "iter_0000040" / "model.safetensors"))
    assert {k for k in trained if "environment_head." in k} == {
        f"{head}.linear_{i}.{p}" for head in ("environment_head", "decoder_environment_head")
        for i in (1, 2) for p in ("weight", "bias")}
    assert trained["decoder_environment_head.linear_1.weight"].shape == (256, 64)  # the decoder's width
    policy = run / "policy"
    exported = set(load_file(str(policy / "model.safetensors"))) | set(load_file(str(policy / "vision.safetensors")))
    assert not any("environment_head" in k for k in exported)
    assert load_checkpoint(policy).card.provenance["environment_state_loss"] == 1.0


def test_the_environment_state_loss_needs_images_and_recorded_state(dataset_dir, tmp_path):
    from trainer.vla import environment_state_targets

    with pytest.raises(SystemExit, match="environment_state_loss needs a vision policy"):
        trainer_main(["vla", "--config", str(_recipe(tmp_path, dataset_dir)), "--vision.cameras", "",
                      "--vision.environment_state_loss", "1"])
    theirs = DemonstrationDataset(Path(__file__).parents[1] / "data" / "lerobot-0.6.1" / "written-by-lerobot")
    with pytest.raises(DatasetError, match="has no observation.environment_state"):
        environment_state_targets(theirs, 1e-3)
    targets = environment_state_targets(DemonstrationDataset(dataset_dir), 1e-3)
    assert targets.min() >= -1 and targets.max() <= 1


def test_data_parallel_2_trains_the_vision_policy_as_one_process_does(dataset_dir, tmp_path):
    """`torchrun --nproc-per-node 2 trainer vla`: the encoder and projector train data-parallel with the
    decoder (their gradients averaged over ranks like every other parameter), so two processes of one
    micro-batch each follow the loss curve of one process accumulating both (global batch 8 either way)."""
    import os
    import subprocess
    import sys

    from tests.trainer.pretrain_data import free_port, read_losses

    recipe = _recipe(tmp_path, dataset_dir, shift=0)  # no augmentation: the same pixels on either layout
    steps = ["--schedule.train_steps", "4", "--policy.export", "false"]
    assert trainer_main(["vla", "--config", str(recipe), "--run_dir", str(tmp_path / "one"), *steps]) == 0
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trainer.cli", "vla", "--config", str(recipe),
         "--run_dir", str(tmp_path / "dp2"), *steps],
        cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    one, two = read_losses(tmp_path / "one"), read_losses(tmp_path / "dp2")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5, (step, one[step], two[step])
    assert one[4] != one[1]  # it trained
    record = (tmp_path / "dp2/checkpoints/iter_0000004/trainer.json").read_text()
    assert '"data": 2' in record and '"world_size": 2' in record
