"""The ``null`` suite's environment: nothing happens, every episode lasts its step limit, and the
seed alone decides success."""

from __future__ import annotations

import numpy as np

from benchmarks.null import SUCCESS_RATE, seeded_success
from benchmarks.registry import get_suite
from benchmarks.runner import run_policy_episode
from benchmarks.suite import evaluation_seed


def test_outcomes_follow_the_seed_and_episodes_last_their_step_limit():
    suite = get_suite("null")
    assert suite.simulator == "null" and suite.leaderboard is False
    assert get_suite("metaworld-mt1-reach").leaderboard is True
    env = suite.make_env("null", evaluation_seed(0))
    zeros = np.zeros(suite.action_dim, dtype=np.float32)
    seeds = [evaluation_seed(i) for i in range(200)]
    first = [run_policy_episode(env, lambda obs: zeros, seed=s) for s in seeds]
    env.max_steps = 3
    short = [run_policy_episode(env, lambda obs: np.ones(2, dtype=np.float32), seed=s) for s in reversed(seeds)]
    assert all(o.steps == 10 for o in first) and all(o.steps == 3 for o in short)
    assert [o.success for o in first] == [seeded_success("null", s) for s in seeds]
    assert [o.success for o in first] == [o.success for o in reversed(short)]  # actions and order do not matter
    assert abs(sum(o.success for o in first) / len(first) - SUCCESS_RATE) < 0.15
    assert first[0].total_reward == float(first[0].success)
