"""`trainer tokenizer`: train a byte-level BPE tokenizer on jsonl corpora.

    trainer tokenizer --input corpus.jsonl [more.jsonl ...] --out tok/ --vocab-size 8000

Byte-level BPE (GPT-2/Llama-3 style: any UTF-8 text encodes, nothing is unknown)
with two special tokens, ``<|endoftext|>`` (id 0: end of document, appended to every
document by ``trainer preprocess``) and ``<|pad|>`` (id 1). The directory is written
with ``save_pretrained`` and loads with ``transformers.PreTrainedTokenizerFast`` /
``AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.data.corpus import CorpusError, check_files, iter_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used; the message names the path and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, nargs="+", type=Path, help="jsonl corpus files")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the tokenizer to")
    parser.add_argument("--vocab-size", type=int, default=8000, help="vocabulary size, special tokens included")
    parser.add_argument("--text-key", default="text", help="JSON field holding each document's text")
    parser.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences for a merge")
    parser.add_argument("--force", action="store_true", help="overwrite an existing tokenizer in --out")


def train_tokenizer(inputs: Sequence[Path | str], out: Path, vocab_size: int = 8000, text_key: str = "text",
                    min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on the corpora and save it to ``out``; returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + 2:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least 258 "
                             "(256 bytes and the two special tokens)")
    files = check_files(inputs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                              special_tokens=[END_OF_TEXT, PAD],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(iter_texts(files, text_key), trainer=bpe)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=PAD)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def load_tokenizer(directory: Path | str) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a local directory (``trainer tokenizer`` output or any HF one)."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer directory {directory} does not exist; train one with "
                             "`trainer tokenizer --input CORPUS.jsonl --out DIR` or point to a Hugging Face "
                             "tokenizer directory")
    if not (directory / "tokenizer.json").is_file():
        raise TokenizerError(f"tokenizer directory {directory} has no tokenizer.json; it must hold a fast "
                             "tokenizer (as `trainer tokenizer` or save_pretrained() writes it)")
    return PreTrainedTokenizerFast.from_pretrained(directory)


def end_of_document_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id appended after every document: the EOS token."""
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"tokenizer {tokenizer.name_or_path} has no EOS token to end documents with; "
                             f"set one (e.g. {END_OF_TEXT}) in its tokenizer_config.json")
    return int(tokenizer.eos_token_id)


def run(args: argparse.Namespace) -> Path:
    out: Path = args.out
    if (out / "tokenizer.json").exists() and not args.force:
        raise SystemExit(f"trainer tokenizer: {out} already holds a tokenizer; pass --force to overwrite it")
    try:
        tokenizer = train_tokenizer(args.input, out, args.vocab_size, args.text_key, args.min_frequency)
    except (CorpusError, TokenizerError) as exc:
        raise SystemExit(f"trainer tokenizer: {exc}") from None
    print(f"wrote a byte-level BPE tokenizer with {len(tokenizer)} tokens to {out}")
    return out
