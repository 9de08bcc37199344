"""``GET /leaderboard``: each policy's best finished evaluation on a suite, ranked."""

from __future__ import annotations

import pytest

from tests.eval_api.conftest import MT10_TASKS
from tests.eval_api.test_evaluations import play


def finished(api, policy_id: int, successes_per_task: int, per_task: int = 4, **body) -> int:
    evaluation = api.submit(policy_id, episodes_per_task=per_task, **body)
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index % per_task < successes_per_task, steps=9))
    return evaluation["id"]


def test_leaderboard_ranks_policies_by_their_best_evaluation(api):
    a = api.register_policy("alpha", "ws://a.test/ws")
    b = api.register_policy("beta", "ws://b.test/ws")
    c = api.register_policy("gamma", "ws://c.test/ws")
    finished(api, a["id"], 1)  # 25%
    a_best = finished(api, a["id"], 3)  # 75%
    b_best = finished(api, b["id"], 4)  # 100% of 40
    finished(api, c["id"], 4, tasks=["reach-v3"])  # 100%, but one task only: not standard
    c_std = finished(api, c["id"], 2)  # 50%
    api.submit(b["id"], episodes_per_task=4)  # still pending: not ranked

    board = api.client.get("/leaderboard", params={"suite": "metaworld-mt10"}).json()
    assert board["suite"] == "metaworld-mt10" and board["include_nonstandard"] is False
    ranked = [(e["rank"], e["policy"]["name"], e["evaluation_id"]) for e in board["entries"]]
    assert ranked == [(1, "beta", b_best), (2, "alpha", a_best), (3, "gamma", c_std)]
    top = board["entries"][0]
    assert top["success_rate"] == 1.0 and top["episodes"] == 4 * len(MT10_TASKS)
    assert top["ci95"]["high"] == 1.0 and top["ci95"]["low"] == pytest.approx(0.9124, abs=1e-4)
    assert top["policy"]["checkpoint_sha256"] == "ab" * 32 and top["finished_at"]

    everything = api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "include_nonstandard": True})
    assert [e["policy"]["name"] for e in everything.json()["entries"]] == ["beta", "gamma", "alpha"]
    assert len(api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "limit": 1}).json()["entries"]) == 1
    assert api.client.get("/leaderboard", params={"suite": "pusht"}).json()["entries"] == []


def test_leaderboard_needs_a_known_suite(api):
    response = api.client.get("/leaderboard", params={"suite": "metaworld-mt100"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "unknown_suite"
    response = api.client.get("/leaderboard")
    assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"
