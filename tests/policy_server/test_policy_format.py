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
    _edit_policy(directory, lambda raw: raw.update(format_version=2))
    result = subprocess.run([sys.executable, "-m", "services.policy_server", "--checkpoint", str(directory)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"checkpoint {directory}: policy.json format_version 2 is not supported" in result.stderr
    assert "Traceback" not in result.stderr


def test_init_policy_refuses_to_overwrite_without_force(checkpoint, tmp_path):
    from trainer.cli import main

    directory = _copy(checkpoint, tmp_path)
    with pytest.raises(SystemExit, match="--force"):
        main(["init-policy", "--out", str(directory), "--state-dim", "3", "--action-dim", "2", "--tasks", "a"])
    with pytest.raises(SystemExit, match="--state-dim"):
        main(["init-policy", "--out", str(tmp_path / "new"), "--tasks", "a"])
