"""`trainer tokenizer` and `trainer preprocess`: round trips, and errors that name the file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.trainer.pretrain_data import make_corpus
from trainer.cli import main as trainer_main


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = make_corpus(root / "corpus.jsonl", documents=200)
    trainer_main(["tokenizer", "--input", str(corpus), "--out", str(root / "tokenizer"), "--vocab-size", "400"])
    return root / "tokenizer"


def test_tokenizer_loads_with_transformers(tokenizer_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    assert 258 < len(tok) <= 400  # a small corpus may run out of merges before the budget
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|pad|>"]
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1
    text = "The robot pushes the red block. Ünïcödé ☃ works too"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: nothing is unknown
    assert AutoTokenizer.from_pretrained(tokenizer_dir).encode(text) == tok.encode(text)


def test_preprocess_writes_documents_with_eod(tokenizer_dir, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import PreTrainedTokenizerFast

    texts = ["the cat sees the box.", "", "a dog likes the door near the window."]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts) + "\n")
    trainer_main(["preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer_dir),
                  "--out", str(tmp_path / "ds"), "--text-key", "body"])
    out = capsys.readouterr().out
    assert "2 documents" in out and "1 empty documents skipped" in out
    dataset = IndexedDataset(str(tmp_path / "ds"))
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    assert len(dataset) == 2
    for doc, text in zip(dataset, [texts[0], texts[2]], strict=True):
        assert doc.dtype == np.uint16
        assert doc[-1] == tok.eos_token_id
        assert tok.decode(doc[:-1].tolist()) == text
    assert not (tmp_path / "ds.bin.partial").exists()


@pytest.mark.parametrize(("line", "problem"), [
    ('{"text": "fine"', r"not valid JSON \(Expecting ',' delimiter"),
    ('["a list"]', r"expected a JSON object, got list"),
    ('{"title": "no text"}', r"no 'text' field \(fields: title\); pass --text-key"),
    ('{"text": 42}', r"field 'text' is int, expected a string"),
])
@pytest.mark.parametrize("verb", ["tokenizer", "preprocess"])
def test_malformed_jsonl_names_file_and_line(verb, line, problem, tokenizer_dir, tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "one"}\n\n{"text": "two"}\n' + line + "\n")
    args = (["tokenizer", "--input", str(corpus), "--out", str(tmp_path / "t")] if verb == "tokenizer" else
            ["preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match=rf"trainer {verb}: {corpus}:4: {problem}"):
        trainer_main(args)
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.bin.partial").exists()


def test_missing_inputs_name_the_path(tokenizer_dir, tmp_path):
    corpus = make_corpus(tmp_path / "c.jsonl", documents=3)
    with pytest.raises(SystemExit, match=rf"tokenizer directory {tmp_path / 'nope'} does not exist; train one"):
        trainer_main(["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "nope"),
                      "--out", str(tmp_path / "d")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"has no tokenizer\.json"):
        trainer_main(["preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "empty"),
                      "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match=rf"{tmp_path / 'missing.jsonl'}: no such file"):
        trainer_main(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer", str(tokenizer_dir),
                      "--out", str(tmp_path / "d")])


def test_pretrain_names_a_missing_dataset(tokenizer_dir, tmp_path):
    with pytest.raises(SystemExit, match=rf"dataset {tmp_path / 'absent'}\.bin does not exist .*trainer preprocess"):
        trainer_main(["pretrain", "--config", "configs/pretrain-tiny.yaml", "--run_dir", str(tmp_path / "run"),
                      "--data.paths", json.dumps([str(tmp_path / "absent")]),
                      "--data.tokenizer_dir", str(tokenizer_dir)])
