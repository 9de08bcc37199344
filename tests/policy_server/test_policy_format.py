"""policy.json validation, tokenization, and refusing bad checkpoints at start."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from services.policy_server.policy_format import CheckpointError, load_policy_spec
from tests.policy_server.conftest import ACTION_DIM, CHUNK, STATE_DIM, TASKS


def _copy(checkpoint, tmp_path, name="ckpt"):
    return shutil.copytree(checkpoint, tmp_path / name)


def _edit_policy(directory, change):
    path = directory / "policy.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_spec_reads_what_init_policy_wrote(checkpoint):
    spec = load_policy_spec(checkpoint)
    assert (spec.state_dim, spec.action_dim, spec.chunk_size) == (STATE_DIM, ACTION_DIM, CHUNK)
    assert tuple(spec.tasks) == TASKS
    assert spec.max_tokens == CHUNK * ACTION_DIM
    assert len(spec.checkpoint_sha256) == 64
    assert spec.provenance["steps"] == 0


def test_prompt_tokens_bin_each_dimension_between_its_bounds(checkpoint):
    spec = load_policy_spec(checkpoint)
    state = np.linspace(-1.5, 1.5, STATE_DIM).astype(np.float32)  # beyond the [-1, 1] bounds at both ends
    tokens = spec.prompt_tokens(state, "push-v3")
    assert tokens[0] == spec.tasks["push-v3"].token_id
    bins = np.array(tokens[1:]) - spec.state_range[0]
    assert bins.min() == 0 and bins.max() == spec.state_bins - 1
    assert (np.diff(bins) >= 0).all()
    assert tokens[1 + STATE_DIM // 2] - spec.state_range[0] == spec.state_bins // 2  # 0.0 → the middle bin


def test_action_tokens_decode_to_bin_centres(checkpoint):
    spec = load_policy_spec(checkpoint)
    start = spec.action_range[0]
    tokens = [start] * ACTION_DIM + [start + spec.action_bins - 1] * ACTION_DIM + [start + 128] * 2 * ACTION_DIM
    actions = spec.decode_actions(tokens)
    assert actions.shape == (CHUNK, ACTION_DIM) and actions.dtype == np.float32
    width = 2.0 / spec.action_bins
    np.testing.assert_allclose(actions[0], -1 + width / 2, rtol=1e-6)
    np.testing.assert_allclose(actions[1], 1 - width / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="outside the action range"):
        spec.decode_actions([0] * spec.max_tokens)


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
def test_bad_policy_json_is_refused_with_the_reason(checkpoint, tmp_path, name):
    change, pattern = BAD[name]
    directory = _copy(checkpoint, tmp_path)
    _edit_policy(directory, change)
    with pytest.raises(CheckpointError, match=pattern):
        load_policy_spec(directory)


@pytest.mark.parametrize("missing", ["policy.json", "config.json", "model.safetensors"])
def test_missing_files_are_named(checkpoint, tmp_path, missing):
    directory = _copy(checkpoint, tmp_path)
    (directory / missing).unlink()
    with pytest.raises(CheckpointError, match=f"missing .*{missing}"):
        load_policy_spec(directory)


def test_policy_server_refuses_a_bad_checkpoint_before_starting(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path)
    _edit_policy(directory, lambda raw: raw.update(format_version=2))
    result = subprocess.run([sys.executable, "-m", "services.policy_server", "--checkpoint", str(directory)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "format_version 2 is not supported" in result.stderr
    assert "Traceback" not in result.stderr


def test_init_policy_refuses_to_overwrite_without_force(checkpoint, tmp_path):
    from trainer.cli import main

    directory = _copy(checkpoint, tmp_path)
    with pytest.raises(SystemExit, match="--force"):
        main(["init-policy", "--out", str(directory), "--state-dim", "3", "--action-dim", "2", "--tasks", "a"])
    with pytest.raises(SystemExit, match="--state-dim"):
        main(["init-policy", "--out", str(tmp_path / "new"), "--tasks", "a"])
