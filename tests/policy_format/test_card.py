"""policy.json: every format version loads, writing is byte-compatible, bad cards and checkpoints are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from policy_format import (
    FORMAT_VERSION,
    READERS,
    CheckpointError,
    PolicyCard,
    PolicyFormatError,
    TokenLayout,
    load_checkpoint,
)
from tests.policy_format.conftest import V1_HAND_LAID, V1_PACKED
from tests.policy_server.conftest import ACTION_DIM, CHUNK, STATE_DIM, TASKS

STATES = np.array([[-1.5, 0.0, 0.0], [0.0, 1.0, 0.1], [0.99, 1.99, 0.49], [-0.875, 0.125, -0.4375]],
                  dtype=np.float32)


def packed_card(**changes) -> PolicyCard:
    """The card V1_PACKED holds, as the trainer constructs it."""
    fields = dict(name="reach-bc", suite="metaworld-mt1-reach", state_dim=3, action_dim=2, chunk_size=2,
                  tasks=["reach-v3", "push-v3"], instructions={"reach-v3": "reach the goal position"},
                  state_low=[-1.0, 0.0, -0.5], state_high=[1.0, 2.0, 0.5], action_low=[-1.0, -1.0],
                  action_high=[1.0, 1.0], state_bins=16, action_bins=8,
                  provenance={"source_commit": "1fc9696", "dataset": "/data/reach-3", "steps": 4})
    return PolicyCard(**{**fields, **changes})


# --------------------------------------------------------------------------- versions


def test_every_format_version_has_a_file_here():
    assert sorted(READERS) == [1] and FORMAT_VERSION == max(READERS)
    for path in (V1_PACKED, V1_HAND_LAID):
        assert json.loads(path.read_text())["format_version"] in READERS


def test_version_1_packed_loads_and_tokenizes_as_the_v1_server_did():
    card = PolicyCard.read(V1_PACKED)
    assert (card.name, card.suite, card.state_dim, card.action_dim, card.chunk_size) == \
        ("reach-bc", "metaworld-mt1-reach", 3, 2, 2)
    assert list(card.tasks) == ["reach-v3", "push-v3"] and card.task_ids == {"reach-v3": 24, "push-v3": 25}
    assert card.instructions == {"reach-v3": "reach the goal position", "push-v3": ""}
    assert card.layout == TokenLayout((0, 16), (16, 24), (24, 26)) == TokenLayout.packed(16, 8, 2)
    tok = card.tokenizer()
    # what services/policy_server/policy_format.py answered for this file at 1fc9696
    assert [tok.prompt("reach-v3", s) for s in STATES] == [[24, 0, 0, 8], [24, 8, 8, 9], [24, 15, 15, 15],
                                                            [24, 1, 1, 1]]
    assert tok.prompt("push-v3", STATES[1]) == [25, 8, 8, 9]
    assert tok.decode_actions([16, 23, 19, 20]).tolist() == [[-0.875, 0.875], [-0.125, 0.125]]


def test_version_1_with_a_hand_laid_layout_loads_as_the_v1_server_read_it():
    card = PolicyCard.read(V1_HAND_LAID)
    assert card.layout == TokenLayout(state_range=(2, 18), action_range=(18, 26), task_range=(0, 2))
    assert card.task_ids == {"reach-v3": 1, "push-v3": 0} and card.instructions["push-v3"] == ""
    tok = card.tokenizer()
    assert [tok.prompt("reach-v3", s) for s in STATES] == [[1, 2, 2, 10], [1, 10, 10, 11], [1, 17, 17, 17],
                                                            [1, 3, 3, 3]]
    assert tok.prompt("push-v3", STATES[1]) == [0, 10, 10, 11]
    assert tok.decode_actions([18, 25, 21, 22]).tolist() == [[-0.875, 0.875], [-0.125, 0.125]]
    assert tok.allowed_token_ids == list(range(18, 26))
    # written back, the card keeps its layout and ids (in the current version's key order)
    again = PolicyCard.from_json(json.loads(json.dumps(card.to_json())))
    assert again.layout == card.layout and again.task_ids == card.task_ids


def test_writing_is_byte_for_byte_what_version_1_wrote(tmp_path):
    assert packed_card().write(tmp_path).read_bytes() == V1_PACKED.read_bytes()
    (tmp_path / "again").mkdir()
    assert PolicyCard.read(V1_PACKED).write(tmp_path / "again").read_bytes() == V1_PACKED.read_bytes()


def test_provenance_gains_the_source_commit_unless_it_has_one(tmp_path):
    from policy_format import source_commit

    card = packed_card(provenance={"steps": 0})
    written = json.loads(card.write(tmp_path).read_text())
    assert written["provenance"] == {"source_commit": source_commit(), "steps": 0}
    assert packed_card().to_json()["provenance"]["source_commit"] == "1fc9696"


def test_an_unknown_version_is_refused_naming_the_versions_this_code_reads(tmp_path):
    raw = json.loads(V1_PACKED.read_text())
    raw["format_version"] = 2
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PolicyFormatError, match=r"policy\.json: policy\.json format_version 2 is not supported; "
                                                r"this EvalForge reads version 1"):
        PolicyCard.read(path)


# --------------------------------------------------------------------------- refusing bad cards


def test_write_refuses_a_card_that_no_reader_would_accept(tmp_path):
    with pytest.raises(PolicyFormatError, match="'state_bounds' must have 3 lows and highs"):
        packed_card(state_low=[-1.0, 0.0]).write(tmp_path)
    with pytest.raises(PolicyFormatError, match="'action_bounds' must be finite with high > low"):
        packed_card(action_high=[1.0, -1.0]).write(tmp_path)
    with pytest.raises(PolicyFormatError, match="appears twice"):
        packed_card(tasks=["reach-v3", "reach-v3"]).write(tmp_path)
    with pytest.raises(PolicyFormatError, match="'chunk_size' must be an integer ≥ 1"):
        packed_card(chunk_size=0).write(tmp_path)
    assert not (tmp_path / "policy.json").exists()


def test_check_vocabulary_names_the_range_that_does_not_fit():
    card = packed_card()
    card.check_vocabulary(26)
    with pytest.raises(PolicyFormatError, match=r"token_ranges\.task ends at 26 but the model's vocabulary has "
                                                r"only 25 ids"):
        card.check_vocabulary(25)


def _copy(checkpoint, tmp_path, name="ckpt"):
    return shutil.copytree(checkpoint, tmp_path / name)


def _edit_policy(directory, change):
    path = directory / "policy.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


BAD = {
    "unknown version": (lambda raw: raw.update(format_version=99), "format_version 99 is not supported"),
    "wrong format": (lambda raw: raw.update(format="other"), "format"),
    "vocab too small": (lambda raw: raw["token_ranges"].update(task=[600, 700]), "vocabulary has only"),
    "overlapping ranges": (lambda raw: raw["token_ranges"].update(action=[100, 356]), "overlaps"),
    "bins mismatch": (lambda raw: raw.update(action_bins=100), "action_bins is 100"),
    "bounds length": (lambda raw: raw["state_bounds"].update(low=[0.0]), "39 lows and highs"),
    "inverted bounds": (lambda raw: raw["action_bounds"].update(low=[2.0] * ACTION_DIM), "high > low"),
    "task outside range": (lambda raw: raw["tasks"][0].update(token_id=1), "outside token_ranges.task"),
    "no tasks": (lambda raw: raw.update(tasks=[]), "lists no tasks"),
    "negative dim": (lambda raw: raw.update(state_dim=0), "'state_dim'"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_policy_json_is_refused_with_the_reason(checkpoint, tmp_path, name):
    change, pattern = BAD[name]
    directory = _copy(checkpoint, tmp_path)
    _edit_policy(directory, change)
    with pytest.raises(CheckpointError, match=f"checkpoint {directory}: .*{pattern}"):
        load_checkpoint(directory)
    with pytest.raises(PolicyFormatError, match=pattern):
        PolicyCard.read(directory, vocab_size=576)  # the card alone: the same rules, given the model's vocabulary


@pytest.mark.parametrize("missing", ["policy.json", "config.json", "model.safetensors"])
def test_missing_files_are_named(checkpoint, tmp_path, missing):
    directory = _copy(checkpoint, tmp_path)
    (directory / missing).unlink()
    with pytest.raises(CheckpointError, match=f"missing .*{missing}"):
        load_checkpoint(directory)


# --------------------------------------------------------------------------- a checkpoint


def test_load_checkpoint_reads_what_init_policy_wrote(checkpoint):
    policy = load_checkpoint(checkpoint)
    tok = policy.tokenizer
    assert (tok.state_dim, tok.action_dim, tok.chunk_size) == (STATE_DIM, ACTION_DIM, CHUNK)
    assert tuple(tok.tasks) == TASKS and policy.name == "policy-1m"
    assert tok.action_len == CHUNK * ACTION_DIM and tok.seq_length == 1 + STATE_DIM + CHUNK * ACTION_DIM
    assert len(policy.checkpoint_sha256) == 64
    assert policy.card.provenance["steps"] == 0
    assert policy.vocab_size == policy.card.layout.vocab_size == 576  # 256 + 256 + 3 → a multiple of 64


def test_the_package_imports_numpy_and_the_standard_library_only():
    """At run time too (tests/test_import_boundaries.py checks the source): no torch, trainer or services."""
    probe = ("import sys; before = set(sys.modules); import policy_format; "
             "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before} "
             "- set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) == {"numpy", "policy_format"}, out.stdout
