"""`trainer rollout` and the shared episode loop, on a real MetaWorld simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_episode
from benchmarks.suite import evaluation_seed
from tests.policy_server.conftest import start_server
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


@pytest.fixture(scope="module")
def reach_policy(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout") / "reach-untrained"
    trainer_main(["init-policy", "--suite", "metaworld-mt1-reach", "--out", str(out)])
    return out


def test_rollout_against_a_running_server_prints_and_writes_the_table(reach_policy, tmp_path, capsys):
    server = start_server(reach_policy, tmp_path, "--engine", "hf")
    try:
        report = tmp_path / "rollout.json"
        trainer_main(["rollout", "--suite", "metaworld-mt1-reach", "--episodes-per-task", "2",
                      "--policy-server", server.ws_url, "--max-steps", "12", "--json", str(report)])
    finally:
        server.stop()
    printed = capsys.readouterr().out
    assert "reach-v3" in printed and "episodes/min" in printed
    data = json.loads(report.read_text())
    seeds = [e["seed"] for e in data["episodes"]]
    assert seeds == [evaluation_seed(0), evaluation_seed(1)]
    assert all(e["steps"] == 12 and e["inferences"] == 3 for e in data["episodes"])  # chunk 4: 12 steps, 3 calls
    overall = data["summary"][-1]
    assert overall["task"] == "all" and overall["episodes"] == 2


def test_rollout_starts_its_own_server_when_given_a_checkpoint(reach_policy, capsys):
    exit_code = trainer_main(["rollout", "--checkpoint", str(reach_policy), "--engine", "hf", "--suite",
                              "metaworld-mt1-reach", "--episodes-per-task", "1", "--max-steps", "4"])
    assert exit_code == 0
    assert "1 episodes" in capsys.readouterr().out


def test_rollout_refuses_a_policy_for_another_suite(reach_policy, tmp_path):
    server = start_server(reach_policy, tmp_path, "--engine", "hf")
    try:
        with pytest.raises(SystemExit, match="no task token for push-v3"):
            trainer_main(["rollout", "--suite", "metaworld-mt1-push", "--episodes-per-task", "1",
                          "--policy-server", server.ws_url])
    finally:
        server.stop()


def test_rollout_names_close_suites_for_a_typo():
    with pytest.raises(SystemExit, match="did you mean: metaworld-mt1-reach"):
        trainer_main(["rollout", "--suite", "metaworld-reach", "--episodes-per-task", "1",
                      "--policy-server", "ws://127.0.0.1:1/ws"])
