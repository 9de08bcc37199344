"""A policy checkpoint directory: the files a server needs, checked before anything loads them.

A policy checkpoint is a directory that ``transformers`` and ``vllm`` both load as a causal
LM, plus its card::

    checkpoint/
      config.json              Hugging Face config (its vocab_size bounds the token ranges)
      model.safetensors        weights (or model.safetensors.index.json + shards)
      policy.json              the card (policy_format/card.py)
      vision.safetensors       vision policies: encoder + projector (the card's vision.weights)
      model.safetensors.index.json   vision policies: names model.safetensors as the LM's only file

A vision policy's second safetensors file sits next to the language model's, so the
directory carries an index (:func:`write_lm_index`) mapping every LM tensor to
``model.safetensors``: loaders that take every ``*.safetensors`` in a directory unless an
index says otherwise (vLLM) then leave the vision weights alone.

:func:`load_checkpoint` validates all of it and returns a :class:`PolicyCheckpoint`: the
card, the tokenizer built from it, the model's vocabulary size and the checkpoint's
sha256 (which the server announces and evaluations record). Weights are not read here,
only hashed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_format.card import FILENAME, PolicyCard, PolicyFormatError
from policy_format.tokens import PolicyTokenizer

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(PolicyFormatError):
    """A checkpoint directory that cannot be served, with what is wrong in it."""


@dataclass(frozen=True, eq=False)
class PolicyCheckpoint:
    """A validated policy checkpoint: where it is, its card and tokenizer, and what identifies it."""

    directory: Path
    card: PolicyCard
    tokenizer: PolicyTokenizer
    vocab_size: int
    """The model's vocabulary (config.json); every token range fits in it."""
    checkpoint_sha256: str

    @property
    def name(self) -> str:
        """The card's name, or the directory's when the card has none."""
        return self.card.name or self.directory.name


def checkpoint_digest(directory: str | Path) -> str:
    """sha256 over the names and bytes of the files that define the policy (``*.json``, ``*.safetensors``)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file() and (path.suffix in {".json", ".safetensors"}):
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as handle:
                while block := handle.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()


def load_checkpoint(directory: str | Path) -> PolicyCheckpoint:
    """Validate a checkpoint directory and return it, or raise :class:`CheckpointError` saying what is wrong."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} is not a directory")
    missing = [name for name in ("config.json", FILENAME) if not (directory / name).is_file()]
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise CheckpointError(f"checkpoint {directory}: missing {', '.join(missing)} (a policy checkpoint needs "
                              "config.json, weights and policy.json)")
    where = f"checkpoint {directory}"
    try:
        raw = json.loads((directory / FILENAME).read_text())
        config = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: invalid JSON: {exc}") from exc
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if type(vocab_size) is not int or vocab_size <= 0:
        raise CheckpointError(f"{where}: config.json has no integer vocab_size")
    try:
        card = PolicyCard.from_json(raw, source=where, vocab_size=vocab_size)
    except PolicyFormatError as exc:
        raise CheckpointError(str(exc)) from None
    if card.vision is not None:
        if not (directory / card.vision.weights).is_file():
            raise CheckpointError(f"{where}: policy.json's vision.weights names {card.vision.weights}, which is not "
                                  "there; copy the whole checkpoint (trainer export writes both weight files)")
        index = _read_index(directory)
        if index is None or card.vision.weights in set(index.get("weight_map", {}).values()):
            raise CheckpointError(f"{where}: a vision policy needs {INDEX_FILE} naming model.safetensors as the "
                                  "language model's file (else vLLM loads the vision weights into it); re-export "
                                  "with trainer export")
    return PolicyCheckpoint(directory=directory, card=card, tokenizer=card.tokenizer(), vocab_size=vocab_size,
                            checkpoint_sha256=checkpoint_digest(directory))


def _read_index(directory: Path) -> dict[str, Any] | None:
    try:
        index = json.loads((directory / INDEX_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return index if isinstance(index, dict) and isinstance(index.get("weight_map"), dict) else None


def write_lm_index(directory: str | Path, tensor_names: list[str], total_size: int) -> Path:
    """Write ``model.safetensors.index.json`` mapping every LM tensor to ``model.safetensors``."""
    path = Path(directory) / INDEX_FILE
    path.write_text(json.dumps({"metadata": {"total_size": int(total_size)},
                                "weight_map": {name: "model.safetensors" for name in sorted(tensor_names)}},
                               indent=2) + "\n")
    return path
