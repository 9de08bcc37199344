"""`trainer sft`: loss goes down on a small chat corpus, and it starts from a pretraining checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.trainer.pretrain_data import read_losses
from tests.trainer.test_sft_data import train_tokenizer, write_jsonl
from trainer.cli import main as trainer_main

ANSWERS = {"colour of the sky": "blue", "sound a cat makes": "meow", "number after two": "three",
           "opposite of hot": "cold"}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tokenizer = train_tokenizer(root / "tok", ["<pad>", "<|im_start|>", "<|im_end|>"])
    records = [{"messages": [{"role": "user", "content": f"What is the {q}?"},
                             {"role": "assistant", "content": f"The {q} is {a}."}]}
               for _ in range(20) for q, a in ANSWERS.items()]
    alpaca = [{"instruction": f"Name the {q}.", "output": a} for _ in range(10) for q, a in ANSWERS.items()]
    return root, tokenizer, [write_jsonl(root / "chat.jsonl", records), write_jsonl(root / "alpaca.jsonl", alpaca)]


def _sft_args(run, tokenizer, data, *extra):
    return ["sft", "--run_dir", str(run), "--data.paths", json.dumps([str(p) for p in data]),
            "--data.tokenizer_dir", str(tokenizer), "--model.hidden_size", "64", "--model.num_layers", "2",
            "--model.num_attention_heads", "4", "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128",
            "--model.seq_length", "64", "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
            "--optimizer.lr", "3e-3", "--schedule.warmup_steps", "2", "--schedule.train_steps", "25",
            "--logging.tensorboard", "false", "--logging.progress", "false", *extra]


def test_sft_loss_goes_down_on_assistant_tokens(chat_data, tmp_path):
    _, tokenizer, data = chat_data
    run = tmp_path / "run"
    trainer_main(_sft_args(run, tokenizer, data))
    losses = read_losses(run)
    assert sorted(losses) == list(range(1, 26))
    assert losses[25] < losses[1] - 2.0, losses
    assert (run / "checkpoints" / "latest").is_file()


def test_sft_starts_from_a_checkpoint_and_refuses_a_shape_mismatch(chat_data, tmp_path):
    _, tokenizer, data = chat_data
    first = tmp_path / "first"
    trainer_main(_sft_args(first, tokenizer, data))
    second = tmp_path / "second"
    trainer_main(_sft_args(second, tokenizer, data, "--data.init_from", str(first / "checkpoints"),
                           "--schedule.train_steps", "3"))
    # Starting from trained weights: the first loss is already near where the first run ended.
    assert read_losses(second)[1] < read_losses(first)[1] - 2.0
    with pytest.raises(SystemExit, match="model.hidden_size"):
        trainer_main(_sft_args(tmp_path / "third", tokenizer, data, "--data.init_from", str(first / "checkpoints"),
                               "--model.hidden_size", "32"))


def test_sft_config_errors_name_the_field(chat_data, tmp_path):
    _, tokenizer, data = chat_data
    with pytest.raises(SystemExit, match="data.template"):
        trainer_main(_sft_args(tmp_path / "r", tokenizer, data, "--data.template", "llama"))
    with pytest.raises(SystemExit, match="data.paths is empty"):
        trainer_main(["sft", "--data.tokenizer_dir", str(tokenizer)])
