"""The ``null`` suite (issue #23) measures the plumbing: its evaluations run like any other but are
never standard, and neither the leaderboard API nor its page ranks it."""

from __future__ import annotations

from tests.eval_api.test_evaluations import play


def test_null_evaluations_are_never_ranked(api):
    policy = api.register_policy("null", "ws://null.test/ws", tasks=("null",), state_dim=4, action_dim=2)
    evaluation = api.submit(policy["id"], suite="null", episodes_per_task=6)
    assert evaluation["standard"] is False  # every task at its standard step limit, and still not ranked
    assert len(api.queue.sent) == 6 and set(api.queue.queues) == {"null"}
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index % 2 == 0, steps=10))
    done = api.client.get(f"/evaluations/{evaluation['id']}", headers=api.auth).json()
    assert done["status"] == "finished" and done["overall"]["success_rate"] == 0.5

    for params in ({"suite": "null"}, {"suite": "null", "include_nonstandard": True}):
        response = api.client.get("/leaderboard", params=params, headers=api.auth)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_ranked"
    page = api.client.get("/ui/", params={"include_nonstandard": True}, headers=api.auth)
    assert page.status_code == 200 and "suite=pusht" in page.text  # suites with no results are listed too
    assert "suite=null" not in page.text and ">null<" not in page.text
