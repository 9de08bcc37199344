"""The rollout command (`services/cli/rollout.py`: `evalforge rollout`, `trainer rollout`), the sequential
rollout (`services.workers.rollout`) and the shared episode loop, on a real MetaWorld simulator against a
real `policy-server --engine hf`; its summary against the store's aggregates on a real store."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.registry import get_suite
from benchmarks.runner import EnvFailure, run_policy_episode
from benchmarks.suite import evaluation_seed
from services.cli import main as evalforge_main
from services.cli.rollout import main as rollout_main
from services.store import queries
from services.store.aggregates import wilson_interval
from services.store.db import make_session_factory
from services.store.models import Evaluation
from services.workers import rollout as rollout_module
from services.workers.rollout import PolicyMismatch, rollout, summarize
from tests.store.databases import sqlite_template, sqlite_url, store_engine  # noqa: F401  (fixtures)
from tests.store.helpers import add_policy
from tests.workers.conftest import REPO
from trainer.cli import main as trainer_main


def test_the_episode_loop_with_the_scripted_expert_succeeds():
    suite = get_suite("metaworld-mt1-reach")
    with suite.make_env("reach-v3", 0) as env:
        outcome = run_policy_episode(env, suite.expert("reach-v3"), seed=evaluation_seed(0))
    assert outcome.success and 0 < outcome.steps < suite.max_steps("reach-v3")
    assert outcome.seed == evaluation_seed(0) and outcome.task == "reach-v3"


def test_a_simulator_exception_is_an_env_failure():
    suite = get_suite("metaworld-mt1-reach")
    with suite.make_env("reach-v3", 0) as env:
        def broken_step(action):
            raise RuntimeError("mujoco exploded")

        env._step = broken_step
        with pytest.raises(EnvFailure, match="mujoco exploded"):
            run_policy_episode(env, lambda obs: np.zeros(4, np.float32), seed=1)


# (task, success, steps, latency mean ms, latency p95 ms, failure reason): a harness failure among them
OUTCOMES = [("reach-v3", True, 40, 12.0, 20.0, None), ("reach-v3", False, 150, 14.0, 25.0, None),
            ("reach-v3", True, 55, 11.0, 18.0, None), ("push-v3", False, None, 9.0, 12.0, "env_error"),
            ("push-v3", True, 90, 13.0, 21.0, None), ("push-v3", False, 150, 15.0, 30.0, None)]


def test_the_rollout_summary_is_the_store_aggregate_of_the_same_episodes(store_engine):  # noqa: F811
    tasks = ["reach-v3", "push-v3"]
    seeds = [evaluation_seed(i % 3) for i in range(len(OUTCOMES))]
    results = [{"task": task, "seed": seed, "success": success, "total_reward": None, "steps": steps,
                "duration_s": 1.5, "failure_reason": reason, "error_message": "mujoco exploded" if reason else None,
                "inferences": 3, "latency_mean_ms": mean_ms, "latency_p95_ms": p95_ms}
               for seed, (task, success, steps, mean_ms, p95_ms, reason) in zip(seeds, OUTCOMES, strict=True)]
    rows = {row.pop("task"): row for row in summarize(results, tasks)}
    assert [row.pop("episode_s") for row in rows.values()] == [1.5, 1.5, 1.5]

    # The same outcomes as an evaluation's episode rows, finished as a worker finishes them.
    sessions = make_session_factory(store_engine)
    with sessions() as session:
        policy = add_policy(session, tasks=tuple(tasks))
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite="metaworld-mt10", tasks=tasks, episodes_per_task=3, seed=0,
            max_steps=None, standard=False, tags=[],
            episodes=[queries.EpisodeSpec(task=r["task"], seed=r["seed"], max_steps=150) for r in results])
        by_key = {(e.task, e.seed): e.id for e in queries.list_episodes(session, created.evaluation.id)}
        for r in results:
            episode_id = by_key[(r["task"], r["seed"])]
            assert queries.claim_episode(session, episode_id, "w", 60)
            queries.finish_episode(session, episode_id, success=r["success"], steps=r["steps"], duration_s=1.5,
                                   latency_mean_ms=r["latency_mean_ms"], latency_p95_ms=r["latency_p95_ms"],
                                   failure_reason=r["failure_reason"], error_message=r["error_message"])
        assert queries.finalize_evaluation_if_done(session, created.evaluation.id)
        stored = queries.evaluation_results(session, session.get(Evaluation, created.evaluation.id))

    assert rows["all"] == stored["overall"]
    assert [rows[task] for task in tasks] == [{k: v for k, v in t.items() if k != "task"} for t in stored["per_task"]]
    # The env_error is reported but left out of the rate: 3 of 5 scored episodes succeeded.
    assert (rows["all"]["episodes"], rows["all"]["scored"], rows["all"]["succeeded"]) == (6, 5, 3)
    assert rows["push-v3"]["failure_reasons"] == {"env_error": 1} and rows["push-v3"]["success_rate"] == 0.5
    low, high = wilson_interval(3, 5)
    assert rows["all"]["ci95"] == {"low": low, "high": high}


def test_a_simulator_failure_is_recorded_and_the_rollout_goes_on(policy_server, monkeypatch):
    real_run_episode, calls = rollout_module.run_policy_episode, []

    def flaky_run_episode(env, policy, *, seed):
        calls.append(seed)
        if len(calls) == 1:
            raise EnvFailure(f"reach-v3 seed {seed}: step 3 failed: mujoco exploded")
        return real_run_episode(env, policy, seed=seed)

    monkeypatch.setattr(rollout_module, "run_policy_episode", flaky_run_episode)
    results = rollout(policy_server.ws_url, "metaworld-mt1-reach", ["reach-v3"], 2, max_steps=8)
    assert [(r["failure_reason"], r["steps"]) for r in results] == [("env_error", None), (None, 8)]
    assert "mujoco exploded" in results[0]["error_message"]
    overall = summarize(results)[-1]
    assert (overall["task"], overall["episodes"], overall["scored"]) == ("all", 2, 1)
    assert overall["failure_reasons"] == {"env_error": 1}


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
    assert overall["task"] == "all" and overall["episodes"] == overall["scored"] == 2 and "ci95" in overall


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


def test_the_expert_rollout_plays_the_scripted_expert_on_the_evaluation_seeds(tmp_path, capsys):
    report = tmp_path / "expert.json"
    assert rollout_main(["--expert", "--suite", "metaworld-mt1-reach-pixels", "--episodes-per-task", "2",
                         "--json", str(report)]) == 0
    assert "the scripted expert" in capsys.readouterr().out
    episodes = json.loads(report.read_text())["episodes"]
    assert [e["seed"] for e in episodes] == [evaluation_seed(0), evaluation_seed(1)]
    # the pixel suite hides the goal from the policy's state: only the expert's own observation
    # (env.expert_observation) lets it reach the goal, and it renders nothing, calls no server
    assert all(e["success"] and e["inferences"] == 0 for e in episodes)
    suite = get_suite("metaworld-mt1-reach-pixels")
    with suite.make_env("reach-v3", 0) as env:
        alone = run_policy_episode(env, lambda _obs: suite.expert("reach-v3")(env.expert_observation()),
                                   seed=evaluation_seed(1))
    assert alone.steps == episodes[1]["steps"]


def test_the_expert_rollout_refuses_a_server_and_a_suite_without_an_expert():
    with pytest.raises(SystemExit, match="leave out --checkpoint and --policy-server"):
        rollout_main(["--expert", "--suite", "metaworld-mt1-reach", "--episodes-per-task", "1",
                      "--policy-server", "ws://127.0.0.1:1/ws"])
    with pytest.raises(SystemExit, match="libero-goal has no scripted expert"):
        rollout_main(["--expert", "--suite", "libero-goal", "--episodes-per-task", "1"])
    with pytest.raises(SystemExit, match="or --expert"):
        rollout_main(["--suite", "metaworld-mt1-reach", "--episodes-per-task", "1"])


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
    """The `trainer rollout` command, which hands its process over to `python -m services.cli.rollout`."""
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
