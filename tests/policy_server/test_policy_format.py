"""The policy server and policy.json: a bad checkpoint is refused before anything starts.

The format itself (every version, validation, tokenization) is tested where it lives, in
``tests/policy_format``; here, that the server uses it and says what is wrong.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def _copy(checkpoint, tmp_path, name="ckpt"):
    return shutil.copytree(checkpoint, tmp_path / name)


def _edit_policy(directory, change):
    path = directory / "policy.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_policy_server_refuses_a_bad_checkpoint_before_starting(checkpoint, tmp_path):
    directory = _copy(checkpoint, tmp_path)
    _edit_policy(directory, lambda raw: raw.update(format_version=99))
    result = subprocess.run([sys.executable, "-m", "services.policy_server", "--checkpoint", str(directory)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"checkpoint {directory}: policy.json format_version 99 is not supported" in result.stderr
    assert "Traceback" not in result.stderr


def test_init_policy_refuses_to_overwrite_without_force(checkpoint, tmp_path):
    from trainer.cli import main

    directory = _copy(checkpoint, tmp_path)
    with pytest.raises(SystemExit, match="--force"):
        main(["init-policy", "--out", str(directory), "--state-dim", "3", "--action-dim", "2", "--tasks", "a"])
    with pytest.raises(SystemExit, match="--state-dim"):
        main(["init-policy", "--out", str(tmp_path / "new"), "--tasks", "a"])


def test_the_cards_camera_caps_are_the_wire_protocols():
    """policy_format and services.protocol import nothing of each other, so each states the caps; they agree."""
    from policy_format import images
    from services.protocol import messages

    assert images.MAX_CAMERAS == messages.MAX_CAMERAS
    assert images.MAX_IMAGE_SIDE == messages.MAX_IMAGE_SIDE
    assert images.CAMERA_NAME_PATTERN.pattern == messages.CAMERA_NAME_PATTERN.pattern
