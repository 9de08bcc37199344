"""`trainer preprocess`: tokenize jsonl text into a Megatron indexed dataset (.bin/.idx).

    trainer preprocess --input corpus.jsonl [more.jsonl ...] --tokenizer tok/ --out data/corpus

writes ``data/corpus.bin`` and ``data/corpus.idx`` with megatron-core's
``IndexedDatasetBuilder``: one document per jsonl line, tokenized without special
tokens, the tokenizer's EOS appended (so GPTDataset knows where documents end).
Give the prefix (``data/corpus``) to ``data.paths`` in a pretrain recipe; several
prefixes with ``data.weights`` make a blend.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.corpus import CorpusError, iter_texts
from trainer.tokenizer import TokenizerError, end_of_document_id, load_tokenizer

_BATCH = 256  # documents per tokenizer call: the Rust tokenizer parallelises inside a batch


@dataclass(frozen=True)
class PreprocessResult:
    prefix: Path
    documents: int
    tokens: int
    skipped_empty: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, nargs="+", type=Path, help="jsonl corpus files")
    parser.add_argument("--tokenizer", required=True, type=Path, help="tokenizer directory")
    parser.add_argument("--out", required=True, type=Path, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    parser.add_argument("--text-key", default="text", help="JSON field holding each document's text")
    parser.add_argument("--force", action="store_true", help="overwrite an existing dataset")


def preprocess(inputs: Sequence[Path | str], tokenizer_dir: Path | str, out: Path | str,
               text_key: str = "text") -> PreprocessResult:
    """Tokenize every document of ``inputs`` into ``out.bin``/``out.idx``."""
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    tokenizer = load_tokenizer(tokenizer_dir)
    eod = end_of_document_id(tokenizer)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    prefix = Path(out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_path, idx_path = get_bin_path(str(prefix)), get_idx_path(str(prefix))
    partial_bin = bin_path + ".partial"
    builder = IndexedDatasetBuilder(partial_bin, dtype=dtype)
    documents = tokens = skipped = 0
    try:
        for batch in _batched(iter_texts(inputs, text_key), _BATCH):
            texts = [t for t in batch if t.strip()]
            skipped += len(batch) - len(texts)
            if not texts:
                continue
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                ids.append(eod)
                builder.add_document(ids, [len(ids)])
                documents += 1
                tokens += len(ids)
        if documents == 0:
            raise CorpusError(f"no documents with text in {', '.join(map(str, inputs))}; nothing to write")
        builder.finalize(idx_path)
    except BaseException:
        builder.data_file.close()
        Path(partial_bin).unlink(missing_ok=True)
        raise
    # the .bin appears under its real name only once the .idx describing it is complete
    Path(partial_bin).replace(bin_path)
    return PreprocessResult(prefix, documents, tokens, skipped)


def _batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def run(args: argparse.Namespace) -> PreprocessResult:
    out: Path = args.out
    if Path(f"{out}.idx").exists() and not args.force:
        raise SystemExit(f"trainer preprocess: {out}.idx already exists; pass --force to overwrite it")
    try:
        result = preprocess(args.input, args.tokenizer, out, args.text_key)
    except (CorpusError, TokenizerError) as exc:
        raise SystemExit(f"trainer preprocess: {exc}") from None
    note = f" ({result.skipped_empty} empty documents skipped)" if result.skipped_empty else ""
    print(f"wrote {out}.bin and {out}.idx: {result.documents} documents, {result.tokens} tokens{note}")
    return result
