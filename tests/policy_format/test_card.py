"""policy.json: every format version loads, writing is byte-compatible, bad cards and checkpoints are refused;
cameras (version 2); vision encoders (version 3)."""

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
    CameraInput,
    CheckpointError,
    PolicyCard,
    PolicyFormatError,
    TokenLayout,
    VisionEncoder,
    load_checkpoint,
)
from tests.policy_format.conftest import (
    EVERY_VERSION,
    V1_HAND_LAID,
    V1_PACKED,
    V2_CAMERAS,
    V2_STATE_ONLY,
    V3_VISION,
)
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


CAMERAS = (CameraInput("corner", 96, 96), CameraInput("gripper", 64, 80, resize="nearest"))


def test_every_format_version_has_a_file_here_and_every_file_loads():
    assert sorted(READERS) == [1, 2, 3] and FORMAT_VERSION == max(READERS)
    versions = {json.loads(path.read_text())["format_version"] for path in EVERY_VERSION}
    assert versions == set(READERS)
    for path in EVERY_VERSION:
        card = PolicyCard.read(path)
        assert card.tokenizer().prompt(card.tasks[0], STATES[1])  # every version still serves


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


def _as_v3(path) -> str:
    text = path.read_text()
    return text.replace('"format_version": 1', '"format_version": 3').replace('"format_version": 2',
                                                                            '"format_version": 3')


VISION = VisionEncoder(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2)
VISION_CAMERAS = (CameraInput("corner", 16, 16, scale="signed"), CameraInput("gripper", 16, 16, scale="signed"))


def test_writing_is_byte_for_byte_what_earlier_versions_wrote_but_for_the_version(tmp_path):
    assert packed_card().write(tmp_path).read_text() == _as_v3(V2_STATE_ONLY)
    assert packed_card(cameras=list(CAMERAS)).write(tmp_path).read_text() == _as_v3(V2_CAMERAS)
    (tmp_path / "again").mkdir()
    assert PolicyCard.read(V2_CAMERAS).write(tmp_path / "again").read_text() == _as_v3(V2_CAMERAS)
    # a version-1 file written again is the current version without cameras: only its version changes
    assert PolicyCard.read(V1_PACKED).write(tmp_path / "again").read_text() == _as_v3(V2_STATE_ONLY)
    assert V2_STATE_ONLY.read_text() == V1_PACKED.read_text().replace('"format_version": 1', '"format_version": 2')
    assert packed_card(cameras=VISION_CAMERAS, vision=VISION).write(tmp_path).read_bytes() == V3_VISION.read_bytes()


def test_version_3_vision_puts_image_rows_between_task_and_state():
    card = PolicyCard.read(V3_VISION)
    assert card.vision == VISION and card.cameras == VISION_CAMERAS
    assert VISION.tokens_per_image == 4 and card.image_len == 8
    tok = card.tokenizer()
    state_only = PolicyCard.read(V2_STATE_ONLY).tokenizer()
    prompt, plain = tok.prompt("push-v3", STATES[1]), state_only.prompt("push-v3", STATES[1])
    assert tok.prompt_len == len(prompt) == 1 + 8 + 3 and tok.image_slice == slice(1, 9)
    assert prompt[0] == plain[0] and prompt[9:] == plain[1:] and prompt[1:9] == [0] * 8
    seq = tok.sequence(["reach-v3", "push-v3"], STATES[:2], np.zeros((2, 2, 2)))
    assert seq.shape == (2, tok.seq_length) and tok.seq_length == 12 + 4
    for version in (V1_PACKED, V2_CAMERAS, V2_STATE_ONLY):
        assert PolicyCard.read(version).vision is None and PolicyCard.read(version).image_len == 0


BAD_VISION = {
    "no cameras": ({"cameras": []}, "vision encoder but no cameras"),
    "camera size": ({"cameras": [{"name": "corner", "height": 16, "width": 24}]},
                    "camera 'corner' is 16x24 but the vision encoder takes 16x16"),
    "patch": ({"vision": {**VISION.to_json(), "patch_size": 5}}, "multiple of vision.patch_size"),
    "unknown field": ({"vision": {**VISION.to_json(), "depth": 2}}, r"unknown fields \['depth'\]"),
    "missing field": ({"vision": {"image_size": 16}}, "vision is incomplete"),
    "weights": ({"vision": {**VISION.to_json(), "weights": "model.safetensors"}}, "vision.weights must name"),
    "feature layer": ({"vision": {**VISION.to_json(), "feature_layer": -3}}, "feature_layer must be"),
}


@pytest.mark.parametrize("name", list(BAD_VISION))
def test_bad_vision_sections_are_refused_naming_the_problem(name):
    changes, pattern = BAD_VISION[name]
    raw = {**json.loads(V3_VISION.read_text()), **changes}
    with pytest.raises(PolicyFormatError, match=pattern):
        PolicyCard.from_json(raw)


def test_version_2_cameras_load_in_order_and_version_1_has_none():
    card = PolicyCard.read(V2_CAMERAS)
    assert card.cameras == CAMERAS
    assert list(card.camera_sizes.items()) == [("corner", (96, 96)), ("gripper", (64, 80))]
    assert CAMERAS[0].resize == "bilinear" and CAMERAS[0].scale == "unit"
    for path in (V1_PACKED, V1_HAND_LAID, V2_STATE_ONLY):
        assert PolicyCard.read(path).cameras == () and PolicyCard.read(path).camera_sizes == {}
    # cameras add no prompt tokens yet (image rows come with vision policies)
    assert card.tokenizer().prompt("reach-v3", STATES[1]) == PolicyCard.read(V1_PACKED).tokenizer().prompt(
        "reach-v3", STATES[1])


def _camera_entry(**changes):
    return {"name": "corner", "height": 96, "width": 96, "resize": "bilinear", "scale": "unit", **changes}


BAD_CAMERAS = {
    "not a list": ({"corner": [96, 96]}, "'cameras' must be a list of camera entries, got dict"),
    "entry not an object": (["corner"], r"cameras\[0\] must be an object"),
    "bad name": ([_camera_entry(name="a/b")], r"cameras\[0\] name 'a/b' must match"),
    "twice": ([_camera_entry(), _camera_entry()], r"cameras\[1\]: camera 'corner' appears twice"),
    "zero height": ([_camera_entry(height=0)], r"camera 'corner'\) height and width must be integers from 1 to 4096"),
    "too wide": ([_camera_entry(width=4097)], "from 1 to 4096, got \\[96, 4097\\]"),
    "float size": ([_camera_entry(width=96.0)], "must be integers"),
    "resize": ([_camera_entry(resize="bicubic")], "resize 'bicubic' is not one of bilinear, nearest"),
    "scale": ([_camera_entry(scale="imagenet")], "scale 'imagenet' is not one of unit, signed"),
    "too many": ([_camera_entry(name=f"c{i}") for i in range(17)], "17 cameras; a policy takes at most 16"),
}


@pytest.mark.parametrize("name", list(BAD_CAMERAS))
def test_bad_cameras_are_refused_naming_the_entry(name):
    cameras, pattern = BAD_CAMERAS[name]
    raw = {**json.loads(V2_CAMERAS.read_text()), "cameras": cameras}
    with pytest.raises(PolicyFormatError, match=pattern):
        PolicyCard.from_json(raw)


def test_write_refuses_a_camera_no_reader_would_accept(tmp_path):
    with pytest.raises(PolicyFormatError, match="resize 'cubic'"):
        packed_card(cameras=[CameraInput("corner", 96, 96, resize="cubic")]).write(tmp_path)
    assert not (tmp_path / "policy.json").exists()


def test_resize_and_scale_default_when_a_file_leaves_them_out():
    raw = {**json.loads(V2_CAMERAS.read_text()), "cameras": [{"name": "top", "height": 96, "width": 96}]}
    assert PolicyCard.from_json(raw).cameras == (CameraInput("top", 96, 96, "bilinear", "unit"),)


def test_provenance_gains_the_source_commit_unless_it_has_one(tmp_path):
    from policy_format import source_commit

    card = packed_card(provenance={"steps": 0})
    written = json.loads(card.write(tmp_path).read_text())
    assert written["provenance"] == {"source_commit": source_commit(), "steps": 0}
    assert packed_card().to_json()["provenance"]["source_commit"] == "1fc9696"


def test_an_unknown_version_is_refused_naming_the_versions_this_code_reads(tmp_path):
    raw = json.loads(V1_PACKED.read_text())
    raw["format_version"] = 4
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PolicyFormatError, match=r"policy\.json: policy\.json format_version 4 is not supported; "
                                                r"this EvalForge reads version 1, 2, 3"):
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
