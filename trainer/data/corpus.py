"""Reading pretraining text corpora: jsonl files, one document per line.

Each line is a JSON object with the document's text under a key (``text`` by
default). A malformed line stops the read with :class:`CorpusError` naming the file,
the line number and what is wrong with it, so a bad line in a large corpus is easy to
find; blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path


class CorpusError(ValueError):
    """A corpus file that cannot be read; the message names the file and line."""


def check_files(paths: Sequence[Path | str]) -> list[Path]:
    """The paths as ``Path``s, after checking that each is a readable file."""
    files = [Path(p) for p in paths]
    if not files:
        raise CorpusError("no input files given; pass one or more jsonl files")
    for path in files:
        if not path.is_file():
            raise CorpusError(f"{path}: no such file; pass jsonl files with one {{\"text\": ...}} object per line")
    return files


def iter_texts(paths: Sequence[Path | str], text_key: str = "text") -> Iterator[str]:
    """Every document's text, file by file, line by line."""
    for path in check_files(paths):
        with path.open("r", encoding="utf-8") as handle:
            lineno = 0
            while True:
                lineno += 1
                try:
                    line = handle.readline()
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not UTF-8 ({exc.reason}); re-encode the file as UTF-8") \
                        from None
                if not line:
                    break
                if not line.strip():
                    continue
                yield _text(line, path, lineno, text_key)


def _text(line: str, path: Path, lineno: int, text_key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                          "fix or remove that line") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    if text_key not in record:
        raise CorpusError(f"{path}:{lineno}: no {text_key!r} field (fields: {', '.join(map(str, record)) or 'none'}); "
                          "pass --text-key to read another field")
    text = record[text_key]
    if not isinstance(text, str):
        raise CorpusError(f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, expected a string")
    return text
