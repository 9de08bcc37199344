"""trainer.metrics.RunLogger: the rich progress bar on a terminal, one line per step elsewhere, and
nothing from ranks other than 0. (metrics.jsonl and TensorBoard are checked on real runs in
test_pretrain.py.)"""

from __future__ import annotations

import json

import pytest

from trainer.metrics import RunLogger

VALUES = {"loss": 2.345678, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 12345.0, "tokens": 512.0}


def test_terminal_shows_a_bar_with_step_loss_lr_tokens_per_s_and_eta(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat stdout as a terminal
    logger = RunLogger(tmp_path, total_steps=5, start_step=0, tensorboard=False)
    logger.log(3, VALUES)
    logger.close()
    shown = capsys.readouterr().out
    for part in ("step", "3/5", "loss 2.3457", "lr 3.00e-04", "12,345 tok/s", "ETA"):
        assert part in shown, (part, shown)
    assert "grad_norm" not in shown  # the plain per-step line is not printed beside the bar
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == pytest.approx(2.345678)


def test_elsewhere_one_plain_line_per_logged_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    logger = RunLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False)
    logger.log(3, VALUES)
    logger.log(4, {**VALUES, "moe_aux_loss": 1.01})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 3/5 loss 2.3457 lr 3.000e-04 grad_norm 0.500 12,345 tok/s",
                     "step 4/5 loss 2.3457 lr 3.000e-04 grad_norm 0.500 12,345 tok/s aux 1.0100"]


def test_other_ranks_write_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    logger = RunLogger(tmp_path / "rank1", total_steps=5, start_step=0, enabled=False)
    logger.log(1, VALUES)
    logger.message("hello")
    logger.close()
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "rank1").exists()
