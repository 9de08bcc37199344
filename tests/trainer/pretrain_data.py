"""Helpers for the pretraining tests: a small learnable corpus, its tokenizer and indexed dataset,
and tiny configs. Each test module builds its own data with these (nothing is downloaded)."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

from trainer.config import PretrainConfig, load_config

SUBJECTS = ["the cat", "a dog", "the robot", "my friend", "the teacher", "a small bird", "the old man"]
VERBS = ["sees", "likes", "pushes", "picks up", "moves", "finds", "follows"]
OBJECTS = ["the red block", "a blue cup", "the green ball", "the box", "a long stick", "the door"]
PLACES = ["in the kitchen", "on the table", "near the window", "at the park", "under the bed"]


def make_corpus(path: Path, documents: int = 600, seed: int = 0) -> Path:
    """Documents of a few template sentences: easy to learn, so the loss falls within steps."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(documents):
            sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
                         for _ in range(rng.randint(2, 6))]
            handle.write(json.dumps({"text": " ".join(sentences).capitalize()}) + "\n")
    return path


def prepare_data(root: Path, documents: int = 600, seed: int = 0, name: str = "corpus",
                 tokenizer_dir: Path | None = None) -> tuple[Path, Path]:
    """(tokenizer dir, dataset prefix) under ``root``; trains a 512-token tokenizer unless one is given."""
    from trainer.preprocess import preprocess
    from trainer.tokenizer import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / f"{name}.jsonl", documents, seed)
    if tokenizer_dir is None:
        tokenizer_dir = root / "tokenizer"
        train_tokenizer([corpus], tokenizer_dir, vocab_size=512)
    prefix = root / name
    preprocess([corpus], tokenizer_dir, prefix)
    return tokenizer_dir, prefix


def tiny_config(run_dir: Path, tokenizer_dir: Path, prefixes: list[Path], *extra: str) -> PretrainConfig:
    """A ~0.3 M-parameter model on the test data; ``extra`` are ``--key value`` overrides."""
    overrides = [
        "--run_dir", str(run_dir),
        "--data.paths", json.dumps([str(p) for p in prefixes]), "--data.tokenizer_dir", str(tokenizer_dir),
        "--model.hidden_size", "64", "--model.num_layers", "2", "--model.num_attention_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--model.seq_length", "64",
        "--training.micro_batch_size", "4", "--training.global_batch_size", "8",
        "--optimizer.lr", "3e-3", "--schedule.warmup_steps", "2", "--schedule.train_steps", "20",
        "--logging.tensorboard", "false", "--logging.progress", "false",
        *extra,
    ]
    return load_config(PretrainConfig, None, overrides)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_losses(run_dir: Path) -> dict[int, float]:
    """step → loss from metrics.jsonl (a resumed run's later lines win)."""
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return losses
