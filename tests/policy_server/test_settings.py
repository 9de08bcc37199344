"""`policy-server`'s settings: POLICY_SERVER_* variables, overridden by flags; each documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.policy_server.cli import build_parser, engine_settings, read_settings
from services.policy_server.settings import PolicyServerSettings


def test_an_environment_variable_sets_a_value_and_a_flag_overrides_it(monkeypatch):
    monkeypatch.setenv("POLICY_SERVER_CHECKPOINT", "/runs/policy")
    monkeypatch.setenv("POLICY_SERVER_PORT", "9100")
    monkeypatch.setenv("POLICY_SERVER_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("POLICY_SERVER_COMPILE", "true")
    settings = read_settings([])
    assert (settings.checkpoint, settings.port, settings.max_num_seqs, settings.compile) == \
        (Path("/runs/policy"), 9100, 64, True)
    assert settings.host == "127.0.0.1"  # the default where neither says otherwise
    settings = read_settings(["--port", "9200", "--checkpoint", "/elsewhere", "--no-compile", "--drain-timeout", "2"])
    assert (settings.checkpoint, settings.port, settings.max_num_seqs, settings.compile) == \
        (Path("/elsewhere"), 9200, 64, False)
    assert settings.drain_timeout_s == 2.0


def test_the_checkpoint_is_required_from_one_or_the_other(monkeypatch, capsys):
    monkeypatch.delenv("POLICY_SERVER_CHECKPOINT", raising=False)
    with pytest.raises(SystemExit):
        read_settings([])
    assert "--checkpoint" in capsys.readouterr().err


def test_bad_values_are_refused_naming_the_flag_or_the_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        read_settings(["--checkpoint", "x", "--port", "70000"])
    assert exc.value.code == 2 and "--port: Input should be less than or equal to 65535" in capsys.readouterr().err
    monkeypatch.setenv("POLICY_SERVER_MEMORY_UTILIZATION", "2")
    with pytest.raises(SystemExit) as exc:
        read_settings(["--checkpoint", "x"])
    assert exc.value.code == 2
    assert "POLICY_SERVER_MEMORY_UTILIZATION: Input should be less than or equal to 1" in capsys.readouterr().err


def test_every_setting_is_a_documented_flag():
    parser = build_parser(PolicyServerSettings(checkpoint="x"))
    dests = {action.dest: action for action in parser._actions if action.option_strings}
    assert set(PolicyServerSettings.model_fields) == set(dests) - {"help"}
    for name, field in PolicyServerSettings.model_fields.items():
        assert field.description and dests[name].help == field.description, name
    assert "--log-level" in dests["log_level"].option_strings


def test_engine_core_flag_sets_the_placement():
    def placed_on_compute(*flags: str) -> bool:
        return engine_settings(read_settings(["--checkpoint", "x", *flags])).engine_core_on_compute_cores

    assert placed_on_compute("--engine-core", "compute")
    assert not placed_on_compute() and not placed_on_compute("--engine-core", "vllm")
    with pytest.raises(SystemExit):
        read_settings(["--checkpoint", "x", "--engine-core", "serving"])


def test_the_environment_reaches_the_command(tmp_path):
    """The real command: a checkpoint named only by POLICY_SERVER_CHECKPOINT is the one it checks."""
    missing = tmp_path / "nowhere"
    result = subprocess.run([sys.executable, "-m", "services.policy_server"], capture_output=True, text=True,
                            timeout=120, env={"POLICY_SERVER_CHECKPOINT": str(missing), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert f"checkpoint {missing} is not a directory" in result.stderr
