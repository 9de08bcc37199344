"""Checkpoints: exact resume, refusing another model shape, and stopping on a NaN loss."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.pretrain_data import prepare_data, read_losses, tiny_config
from trainer.cli import main as trainer_main
from trainer.config import save_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-data")
    tokenizer, prefix = prepare_data(root)
    return tokenizer, prefix


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_resume_is_exact(data, tmp_path, dropout):
    """20 steps straight == 10 steps, stop, --resume auto, 10 more (losses, weights, optimizer)."""
    from safetensors.torch import load_file

    from trainer.pretrain import pretrain

    tokenizer, prefix = data
    extra = ["--model.attention_dropout", str(dropout), "--model.hidden_dropout", str(dropout)]
    pretrain(tiny_config(tmp_path / "straight", tokenizer, [prefix], *extra))
    first = pretrain(tiny_config(tmp_path / "split", tokenizer, [prefix], "--training.exit_at_step", "10", *extra))
    assert first.step == 10 and (tmp_path / "split/checkpoints/latest").read_text().strip() == "iter_0000010"
    second = pretrain(tiny_config(tmp_path / "split", tokenizer, [prefix], "--checkpoint.resume", "auto", *extra))
    assert second.resumed_from == str(tmp_path / "split/checkpoints/iter_0000010")
    assert sorted(second.losses) == list(range(11, 21))

    straight, split = read_losses(tmp_path / "straight"), read_losses(tmp_path / "split")
    assert sorted(straight) == sorted(split) == list(range(1, 21))
    for step in straight:
        assert abs(straight[step] - split[step]) <= 1e-6, (step, straight[step], split[step])
    a = load_file(str(tmp_path / "straight/checkpoints/iter_0000020/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/iter_0000020/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_model_shape(data, tmp_path):
    tokenizer, prefix = data
    recipe = save_config(tiny_config(tmp_path / "run", tokenizer, [prefix], "--schedule.train_steps", "2"),
                         tmp_path / "recipe.yaml")
    trainer_main(["pretrain", "--config", str(recipe)])
    with pytest.raises(SystemExit) as refused:
        trainer_main(["pretrain", "--config", str(recipe), "--resume", "auto", "--schedule.train_steps", "4",
                      "--model.hidden_size", "96", "--model.num_layers", "3"])
    message = str(refused.value)
    assert f"cannot resume from {tmp_path / 'run/checkpoints/iter_0000002'}" in message
    assert "model.hidden_size: checkpoint 64, config 96" in message
    assert "model.num_layers: checkpoint 2, config 3" in message
    assert "model.ffn_hidden_size" not in message
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "iter_0000002"


def test_resume_from_an_explicit_path_and_a_bad_one(data, tmp_path):
    tokenizer, prefix = data
    recipe = save_config(tiny_config(tmp_path / "run", tokenizer, [prefix], "--schedule.train_steps", "2"),
                         tmp_path / "recipe.yaml")
    trainer_main(["pretrain", "--config", str(recipe)])
    with pytest.raises(SystemExit, match=r"--resume .*nowhere: not a checkpoint \(no trainer\.json\)"):
        trainer_main(["pretrain", "--config", str(recipe), "--resume", str(tmp_path / "nowhere")])
    trainer_main(["pretrain", "--config", str(recipe), "--resume", str(tmp_path / "run/checkpoints/iter_0000002"),
                  "--schedule.train_steps", "3", "--run_dir", str(tmp_path / "run2")])
    assert sorted(read_losses(tmp_path / "run2")) == [3]


class PoisonAt:
    """A batch source that turns one micro-batch's loss mask into NaN (the loss then is NaN)."""

    def __init__(self, source, micro_index):
        self.source, self.micro_index, self.seen = source, micro_index, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.source)
        if self.seen == self.micro_index:
            batch["loss_mask"] = batch["loss_mask"] * float("nan")
        self.seen += 1
        return batch

    def state_dict(self):
        return self.source.state_dict()

    def load_state_dict(self, state):
        self.source.load_state_dict(state)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(data, tmp_path):
    from trainer import parallel
    from trainer.data.gpt import GPTBatches, build_train_dataset
    from trainer.loop import NonFiniteLoss, train
    from trainer.model import build_model
    from trainer.pretrain import resolve_vocab

    tokenizer, prefix = data
    cfg = resolve_vocab(tiny_config(tmp_path / "run", tokenizer, [prefix], "--checkpoint.save_every", "5"))
    layout = parallel.initialize(cfg.parallel, cfg.training.seed)
    try:
        model = build_model(cfg.model)
        batches = GPTBatches(build_train_dataset(cfg, 160), micro_batch_size=4, global_batch_size=8)
        with pytest.raises(NonFiniteLoss) as stopped:
            train(cfg, model, PoisonAt(batches, micro_index=2 * 7 + 1), layout)  # 2nd micro-batch of step 8
    finally:
        parallel.shutdown()
    last_good = tmp_path / "run/checkpoints/iter_0000005"
    assert stopped.value.step == 8
    assert "loss is nan at step 8; stopped without saving" in str(stopped.value)
    assert f"the last good checkpoint is {last_good}" in str(stopped.value)
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "iter_0000005"
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["iter_0000005", "latest"]
    assert max(read_losses(tmp_path / "run")) == 7
    assert json.loads((last_good / "trainer.json").read_text())["step"] == 5


def test_generic_sources_shard_over_data_parallel_ranks_and_resume_by_replay():
    from trainer.loop import DataParallelShard, ReplaySource, resumable

    def numbers():
        return ({"tokens": torch.tensor([i])} for i in range(100))

    # global sequence 0, 1, 2, ...; 2 micro-batches per rank per step, 2 ranks: rank 1 takes 2, 3, 6, 7, ...
    shard = DataParallelShard(ReplaySource(numbers()), per_rank=2, data_rank=1, data_size=2)
    assert [int(next(shard)["tokens"]) for _ in range(4)] == [2, 3, 6, 7]
    state = shard.state_dict()
    again = DataParallelShard(ReplaySource(numbers()), per_rank=2, data_rank=1, data_size=2)
    again.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint stores
    assert [int(next(again)["tokens"]) for _ in range(2)] == [10, 11]
    plain = resumable(numbers())
    assert isinstance(plain, ReplaySource) and resumable(plain) is plain


def test_resuming_a_finished_run_reports_its_step_and_trains_nothing(data, tmp_path):
    from trainer.pretrain import pretrain

    tokenizer, prefix = data
    done = pretrain(tiny_config(tmp_path / "run", tokenizer, [prefix], "--schedule.train_steps", "4",
                                "--schedule.warmup_steps", "1"))
    again = pretrain(tiny_config(tmp_path / "run", tokenizer, [prefix], "--schedule.train_steps", "4",
                                 "--schedule.warmup_steps", "1", "--checkpoint.resume", "auto"))
    assert done.step == again.step == 4
    assert again.losses == {}
