"""The rollout command (`services.workers.rollout`: `evalforge rollout`, `trainer rollout`) and the
shared episode loop, on a real MetaWorld simulator against a real `policy-server --engine hf`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_episode
from benchmarks.suite import evaluation_seed
from services.cli import main as evalforge_main
from services.workers.rollout import PolicyMismatch, rollout
from services.workers.rollout import main as rollout_main
from tests.workers.conftest import REPO
from trainer.cli import main as trainer_main


def test_the_episode_loop_with_the_scripted_expert_succeeds():
    suite = get_suite("metaworld-mt1-reach")
    with suite.make_env("reach-v3", 0) as env:
        outcome = run_episode(env, suite.expert("reach-v3"), seed=evaluation_seed(0))
    assert outcome.success and 0 < outcome.steps < suite.max_steps("reach-v3")
    assert outcome.seed == evaluation_seed(0) and outcome.task == "reach-v3"


def test_a_simulator_exception_is_an_env_failure():
    suite = get_suite("metaworld-mt1-reach")
    with suite.make_env("reach-v3", 0) as env:
        def broken_step(action):
            raise RuntimeError("mujoco exploded")

        env._step = broken_step
        with pytest.raises(EnvFailure, match="mujoco exploded"):
            run_episode(env, lambda obs: np.zeros(4, np.float32), seed=1)


def test_rollout_against_a_running_server_prints_and_writes_the_table(policy_server, tmp_path, capsys):
    report = tmp_path / "rollout.json"
    assert rollout_main(["--suite", "metaworld-mt1-reach", "--episodes-per-task", "2", "--policy-server",
                         policy_server.ws_url, "--max-steps", "12", "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "reach-v3" in printed and "episodes/min" in printed
    data = json.loads(report.read_text())
    seeds = [e["seed"] for e in data["episodes"]]
    assert seeds == [evaluation_seed(0), evaluation_seed(1)]
    assert all(e["steps"] == 12 and e["inferences"] == 3 for e in data["episodes"])  # chunk 4: 12 steps, 3 calls
    overall = data["summary"][-1]
    assert overall["task"] == "all" and overall["episodes"] == 2


def test_rollout_starts_its_own_server_when_given_a_checkpoint(reach_checkpoint, capsys):
    assert evalforge_main(["rollout", "--checkpoint", str(reach_checkpoint), "--engine", "hf", "--suite",
                           "metaworld-mt1-reach", "--episodes-per-task", "1", "--max-steps", "4"]) == 0
    assert "1 episodes" in capsys.readouterr().out


def test_rollout_refuses_a_policy_for_another_suite(policy_server):
    with pytest.raises(PolicyMismatch, match="no task token for push-v3"):
        rollout(policy_server.ws_url, "metaworld-mt1-push", ["push-v3"], 1)
    with pytest.raises(SystemExit, match="^evalforge rollout: policy .* no task token for push-v3"):
        evalforge_main(["rollout", "--suite", "metaworld-mt1-push", "--episodes-per-task", "1",
                        "--policy-server", policy_server.ws_url])


def test_rollout_names_close_suites_for_a_typo():
    with pytest.raises(SystemExit, match="did you mean: metaworld-mt1-reach"):
        rollout_main(["--suite", "metaworld-reach", "--episodes-per-task", "1", "--policy-server",
                      "ws://127.0.0.1:1/ws"])


def test_evalforge_rollout_has_the_flags_of_the_module(capsys):
    with pytest.raises(SystemExit) as exit_info:
        evalforge_main(["rollout", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: evalforge rollout") and "--episodes-per-task" in printed


def trainer_rollout(*args: str) -> subprocess.CompletedProcess:
    """The `trainer rollout` command, which hands its process over to `python -m services.workers.rollout`."""
    return subprocess.run([sys.executable, "-m", "trainer.cli", "rollout", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_trainer_rollout_runs_the_command_and_prints_the_per_task_table(policy_server, tmp_path):
    report = tmp_path / "rollout.json"
    result = trainer_rollout("--suite", "metaworld-mt1-reach", "--episodes-per-task", "2", "--policy-server",
                             policy_server.ws_url, "--max-steps", "8", "--json", str(report))
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}
    assert {"reach-v3", "all"} <= set(rows) and "episodes/min" in result.stdout
    assert [row["episodes"] for row in json.loads(report.read_text())["summary"]] == [2, 2]


def test_trainer_rollout_speaks_as_trainer_rollout():
    result = trainer_rollout("--suite", "metaworld-reach", "--episodes-per-task", "1", "--policy-server",
                             "ws://127.0.0.1:1/ws")
    assert result.returncode == 1
    assert result.stderr.startswith("trainer rollout: unknown benchmark suite 'metaworld-reach'"), result.stderr
    usage = trainer_rollout("--help")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: trainer rollout"), usage.stderr


def test_trainer_rollout_without_the_services_names_the_extras_and_evalforge_rollout(monkeypatch, capsys):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, package=None: None)  # not installed
    assert trainer_main(["rollout", "--suite", "metaworld-mt1-reach", "--episodes-per-task", "1"]) == 2
    message = capsys.readouterr().err
    assert "pip install 'evalforge[services,sim]'" in message and "`evalforge rollout` is the same command" in message
