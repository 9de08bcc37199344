"""``GET /leaderboard``: each policy's comparable finished evaluations on a suite pooled, ranked."""

from __future__ import annotations

import re

import pytest

from tests.eval_api.conftest import MT10_TASKS
from tests.eval_api.test_evaluations import play


def finished(api, policy_id: int, successes_per_task: int, per_task: int = 4, **body) -> int:
    evaluation = api.submit(policy_id, episodes_per_task=per_task, **body)
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index % per_task < successes_per_task, steps=9))
    return evaluation["id"]


def test_leaderboard_ranks_policies_on_their_pooled_evaluations(api):
    a = api.register_policy("alpha", "ws://a.test/ws")
    b = api.register_policy("beta", "ws://b.test/ws")
    c = api.register_policy("gamma", "ws://c.test/ws")
    a_worse = finished(api, a["id"], 1)  # 25%
    a_better = finished(api, a["id"], 3)  # 75%: pooled with the 25%, alpha is at 50% of 80
    b_best = finished(api, b["id"], 4)  # 100% of 40
    finished(api, c["id"], 4, tasks=["reach-v3"])  # 100%, but one task only: not standard
    c_std = finished(api, c["id"], 3)  # 75% of 40
    api.submit(b["id"], episodes_per_task=4)  # still pending: not ranked

    board = api.client.get("/leaderboard", params={"suite": "metaworld-mt10"}).json()
    assert board["suite"] == "metaworld-mt10" and board["include_nonstandard"] is False
    ranked = [(e["rank"], e["policy"]["name"], e["evaluation_ids"]) for e in board["entries"]]
    assert ranked == [(1, "beta", [b_best]), (2, "gamma", [c_std]), (3, "alpha", [a_worse, a_better])]
    top, second, third = board["entries"]
    assert top["success_rate"] == 1.0 and top["episodes"] == 4 * len(MT10_TASKS)
    assert top["ci95"]["high"] == 1.0 and top["ci95"]["low"] == pytest.approx(0.9124, abs=1e-4)
    assert top["policy"]["checkpoint_sha256"] == "ab" * 32 and top["finished_at"]
    assert top["not_different_from_above"] is False and top["difference_from_above"] is None
    assert third["success_rate"] == 0.5 and third["episodes"] == 80 and third["successes"] == 40
    # Every evaluation runs the same seeds: neighbours are compared on paired (task, seed) episodes.
    assert second["difference_from_above"]["method"] == "paired" and second["difference_from_above"]["pairs"] == 40
    assert second["difference_from_above"]["difference"] == pytest.approx(-0.25)
    assert second["not_different_from_above"] is False  # 10 discordant pairs, all one way: p = 0.002
    assert third["difference_from_above"]["pairs"] == 40  # alpha's two runs of each seed pair once with gamma's

    everything = api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "include_nonstandard": True})
    assert [e["policy"]["name"] for e in everything.json()["entries"]] == ["beta", "gamma", "alpha"]
    assert everything.json()["entries"][1]["episodes"] == 44  # gamma's subset run pooled with its full one
    assert len(api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "limit": 1}).json()["entries"]) == 1
    assert api.client.get("/leaderboard", params={"suite": "pusht"}).json()["entries"] == []


def test_leaderboard_needs_a_known_suite(api):
    response = api.client.get("/leaderboard", params={"suite": "metaworld-mt100"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "unknown_suite"
    response = api.client.get("/leaderboard")
    assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"


def _page_ranking(api, suite: str, include_nonstandard: bool) -> tuple[dict[str, int], list[str]]:
    """The leaderboard page's suite tabs (suite → policies ranked) and the chosen suite's policies, in order."""
    html = api.client.get("/ui/", params={"suite": suite, "include_nonstandard": include_nonstandard}).text
    tabs = {name: int(count) for name, count in re.findall(r'>([\w.-]+)<span class="count">(\d+)</span>', html)}
    return tabs, re.findall(r'<td class="policy"><a href="/ui/policies/\d+">([^<]+)</a>', html)


def test_the_page_and_the_api_rank_by_the_one_eligibility_rule(api):
    """Each condition of ``queries.leaderboard_eligibility`` once: the page's counts and rows, the API's
    leaderboard and the rule itself name the same policies."""
    from sqlalchemy import distinct, func, select

    from services.store import queries
    from services.store.models import Evaluation

    ids = {name: api.register_policy(name, f"ws://{name}.test/ws")["id"]
           for name in ("standard", "subset", "pending", "cancelled", "scoreless")}
    finished(api, ids["standard"], 2)  # finished, every task: always ranked
    finished(api, ids["subset"], 3, tasks=["reach-v3"])  # finished, one task: ranked only with subsets
    api.submit(ids["pending"], episodes_per_task=1)  # not finished: never ranked
    cancelled = api.submit(ids["cancelled"], episodes_per_task=1)["id"]
    assert api.client.post(f"/evaluations/{cancelled}/cancel", headers=api.auth).status_code == 200
    scoreless = api.submit(ids["scoreless"], episodes_per_task=1, tasks=["push-v3"])["id"]  # only harness failures
    play(api, scoreless, lambda e: dict(success=False, failure_reason="env_error"))

    expected = {False: ["standard"], True: ["subset", "standard"]}
    for include_nonstandard, names in expected.items():
        board = api.client.get("/leaderboard", params={"suite": "metaworld-mt10",
                                                       "include_nonstandard": include_nonstandard}).json()
        assert [e["policy"]["name"] for e in board["entries"]] == names
        tabs, rows = _page_ranking(api, "metaworld-mt10", include_nonstandard)
        assert rows == names and tabs == {"metaworld-mt10": len(names)}
        with api.sessions() as session:
            assert queries.ranked_policy_counts(session, include_nonstandard=include_nonstandard) == tabs
            by_rule = session.scalar(select(func.count(distinct(Evaluation.policy_id))).where(
                Evaluation.suite == "metaworld-mt10",
                *queries.leaderboard_eligibility(include_nonstandard=include_nonstandard)))
        assert by_rule == len(names)
