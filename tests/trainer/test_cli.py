"""The `trainer` command line: the same spelling on every verb, and no known-harmless library warnings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import VERBS, main

REPO = Path(__file__).resolve().parents[2]
IMPORT_OPTIMIZER = "import megatron.core.optimizer"


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_takes_log_level(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--log-level", "debug", "--help"])
    assert exit_.value.code == 0
    assert "--log-level" in capsys.readouterr().out


def test_a_wrong_log_level_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["tokenizer", "--log-level", "loud", "--help"])
    assert "choose from 'debug', 'info', 'warning', 'error'" in capsys.readouterr().err


def test_vla_takes_its_recipe_with_config_like_pretrain_and_sft(capsys):
    for verb in ("vla", "pretrain", "sft"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        assert "--config FILE" in capsys.readouterr().out.replace("--config CONFIG", "--config FILE")
    with pytest.raises(SystemExit):
        main(["vla", "configs/vla-reach-fast.yaml"])  # the old positional form names what is missing
    assert "--config" in capsys.readouterr().err


def test_export_writes_to_out_like_init_policy_and_collect_demos(capsys):
    with pytest.raises(SystemExit):
        main(["export", "runs/ckpt"])
    assert "the following arguments are required: --out" in capsys.readouterr().err


def _stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=300).stderr


def test_megatron_notes_about_missing_apex_and_transformer_engine_are_filtered_where_the_trainer_starts():
    # Without the filter megatron-core does print them (so the second assertion can fail) ...
    assert "Transformer Engine and Apex are not installed" in _stderr_of(IMPORT_OPTIMIZER)
    # ... and the trainer's entry point hides them, and nothing else.
    quiet = _stderr_of(f"from trainer.cli import quiet_known_warnings; quiet_known_warnings(); {IMPORT_OPTIMIZER}\n"
                       "import warnings; warnings.warn('a warning of ours')")
    assert "Transformer Engine" not in quiet and "Apex" not in quiet
    assert "a warning of ours" in quiet


def test_init_policy_declares_the_cameras_it_is_given(tmp_path):
    from policy_format import CameraInput, load_checkpoint

    args = ["init-policy", "--state-dim", "3", "--action-dim", "2", "--tasks", "reach-v3", "--layers", "1"]
    main([*args, "--out", str(tmp_path / "square"), "--cameras", "corner,gripper", "--image-size", "96"])
    assert load_checkpoint(tmp_path / "square").card.cameras == (CameraInput("corner", 96, 96),
                                                                  CameraInput("gripper", 96, 96))
    main([*args, "--out", str(tmp_path / "oblong"), "--cameras", "gripper", "--image-size", "64x80"])
    assert load_checkpoint(tmp_path / "oblong").card.camera_sizes == {"gripper": (64, 80)}
    main([*args, "--out", str(tmp_path / "state")])
    assert load_checkpoint(tmp_path / "state").card.cameras == ()


@pytest.mark.parametrize("extra, message", [
    (["--cameras", "corner", "--image-size", "96x"], "'96x' is not an image size; give N"),
    (["--cameras", "corner", "--image-size", "0"], "'0' is not an image size"),
    (["--cameras", "corner"], "--cameras without --suite needs --image-size"),
    (["--image-size", "96"], "--image-size needs --cameras"),
    (["--cameras", "corner,corner", "--image-size", "96"], "distinct cameras"),
    (["--cameras", "a/b", "--image-size", "96"], r"name 'a/b' must match"),
    (["--cameras", "corner", "--image-size", "5000"], "height and width must be integers from 1 to 4096"),
])
def test_init_policy_refuses_bad_cameras_before_writing_anything(tmp_path, capsys, extra, message):
    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_:
        main(["init-policy", "--out", str(out), "--state-dim", "3", "--action-dim", "2", "--tasks", "t", *extra])
    assert exit_.value.code != 0
    assert re.search(message, str(exit_.value.code) + capsys.readouterr().err)
    assert not out.exists()


def test_init_policy_takes_a_suites_cameras_at_their_default_size_or_the_one_given(tmp_path):
    from policy_format import load_checkpoint

    args = ["init-policy", "--suite", "metaworld-mt1-reach", "--layers", "1"]
    main([*args, "--out", str(tmp_path / "default"), "--cameras", "corner,gripper"])
    assert load_checkpoint(tmp_path / "default").card.camera_sizes == {"corner": (96, 96), "gripper": (96, 96)}
    main([*args, "--out", str(tmp_path / "sized"), "--cameras", "gripper", "--image-size", "128x64"])
    assert load_checkpoint(tmp_path / "sized").card.camera_sizes == {"gripper": (128, 64)}
    with pytest.raises(SystemExit, match="has no camera 'top' .*its cameras: corner, gripper"):
        main([*args, "--out", str(tmp_path / "bad"), "--cameras", "top"])
    assert not (tmp_path / "bad").exists()
