"""The `trainer` command line: the same spelling on every verb, and no known-harmless library warnings."""

from __future__ import annotations

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
