"""``GET /comparisons``, the comparison page and ``evalforge eval compare``, on each store backend.

Evaluations are built and played with the store functions the workers call, each
episode's outcome chosen by (task, index), so every figure can be checked by hand and
against ``services.store.statistics``.
"""

from __future__ import annotations

import json

import pytest

from services.cli import main
from services.store import queries
from services.store.statistics import mcnemar_exact, newcombe_paired_interval
from tests.eval_api.conftest import Api, make_api
from tests.eval_api.test_client_cli import serve
from tests.store.helpers import TASKS, add_evaluation, add_policy

Outcomes = dict[str, list[str]]  # task -> per episode: "s" succeeded, "f" failed, "e" env_error, "p" not run


def build(api: Api, name: str, outcomes: Outcomes, *, seed: int = 0, finalize: bool = True,
          artifacts: bool = False) -> int:
    """An evaluation of policy ``name`` on TASKS whose episodes end as ``outcomes`` says."""
    per_task = len(next(iter(outcomes.values())))
    with api.sessions() as session:
        policy = queries.find_policy(session, name, "v1") or add_policy(session, name=name)
        created = add_evaluation(session, policy, per_task=per_task, seed=seed)
        episodes = queries.list_episodes(session, created.evaluation.id, limit=10_000)
        for episode in episodes:
            outcome = outcomes[episode.task][episode.seed - 1_000_000 - seed]
            if outcome == "p":
                continue
            assert queries.claim_episode(session, episode.id, "w", 60)
            queries.finish_episode(session, episode.id, success=outcome == "s", steps=10,
                                   failure_reason="env_error" if outcome == "e" else None,
                                   artifact_path=f"replays/{episode.id}.gif" if artifacts else None)
        if finalize:
            queries.finalize_evaluation_if_done(session, created.evaluation.id)
        return created.evaluation.id


def compare(api: Api, baseline: int, candidate: int, expect: int = 200) -> dict:
    response = api.client.get("/comparisons", params={"baseline": baseline, "candidate": candidate})
    assert response.status_code == expect, response.text
    return response.json()


def test_paired_comparison_per_task_and_overall(api):
    # reach: b = 1 (index 0), c = 3 (1, 2, 3); push: b = 0, c = 2; the rest agree.
    baseline = build(api, "base", {"reach-v3": list("sffffsfs"), "push-v3": list("ffsfsfff")})
    candidate = build(api, "cand", {"reach-v3": list("fsssfsfs"), "push-v3": list("sssfsfff")})
    body = compare(api, baseline, candidate)
    assert body["live"] is False
    assert body["baseline"]["evaluation"]["id"] == baseline and body["candidate"]["evaluation"]["id"] == candidate
    reach, push = body["per_task"]
    assert [reach["task"], push["task"]] == list(TASKS)
    assert (reach["pairs"], reach["both_succeeded"], reach["baseline_only"], reach["candidate_only"],
            reach["both_failed"]) == (8, 2, 1, 3, 2)
    assert reach["baseline_rate"] == 3 / 8 and reach["candidate_rate"] == 5 / 8 and reach["difference"] == 2 / 8
    assert (reach["ci95"]["low"], reach["ci95"]["high"]) == pytest.approx(newcombe_paired_interval(2, 1, 3, 2))
    assert reach["p_value"] == pytest.approx(mcnemar_exact(1, 3))
    assert (push["baseline_only"], push["candidate_only"]) == (0, 2)
    overall = body["overall"]
    assert overall["task"] is None and overall["pairs"] == 16
    assert (overall["both_succeeded"], overall["baseline_only"], overall["candidate_only"],
            overall["both_failed"]) == (4, 1, 5, 6)
    assert overall["difference"] == pytest.approx(4 / 16)
    assert overall["p_value"] == pytest.approx(mcnemar_exact(1, 5))
    assert body["verdict"] == "no detectable difference at n = 16 (p = 0.22)"
    assert body["discordant_total"] == 6 and len(body["discordant"]) == 6
    assert {p["succeeded"] for p in body["discordant"] if p["task"] == "push-v3"} == {"candidate"}
    assert body["unpaired"] == [] and body["unpaired_total"] == 0
    assert "Newcombe" in body["interval_method"] and "McNemar" in body["test_method"]


def test_a_clear_difference_has_a_verdict_and_reversing_the_sides_reverses_it(api):
    baseline = build(api, "base", {"reach-v3": list("f" * 12), "push-v3": list("sf" * 6)})
    candidate = build(api, "cand", {"reach-v3": list("s" * 12), "push-v3": list("s" * 12)})
    body = compare(api, baseline, candidate)
    assert (body["overall"]["baseline_only"], body["overall"]["candidate_only"]) == (0, 18)
    assert body["verdict"] == "candidate better (p < 0.001, n = 24)"
    assert body["overall"]["ci95"]["low"] > 0
    reverse = compare(api, candidate, baseline)
    assert reverse["verdict"] == "baseline better (p < 0.001, n = 24)"
    assert reverse["overall"]["difference"] == -body["overall"]["difference"]
    assert reverse["overall"]["ci95"]["high"] == pytest.approx(-body["overall"]["ci95"]["low"])


def test_harness_failures_are_left_out_of_both_sides_and_their_partners_listed(api):
    baseline = build(api, "base", {"reach-v3": list("esss"), "push-v3": list("ffff")})
    candidate = build(api, "cand", {"reach-v3": list("ssse"), "push-v3": list("ffff")})
    body = compare(api, baseline, candidate)
    assert body["baseline"]["harness_failures"] == {"env_error": 1}
    assert body["candidate"]["harness_failures"] == {"env_error": 1}
    assert body["per_task"][0]["pairs"] == 2 and body["overall"]["pairs"] == 6
    assert body["unpaired_total"] == 2
    unpaired = {(u["side"], u["seed"] - 1_000_000): u["reason"] for u in body["unpaired"]}
    assert unpaired == {("candidate", 0): "the baseline's episode is a harness failure (env_error)",
                        ("baseline", 3): "the candidate's episode is a harness failure (env_error)"}
    assert body["verdict"] == "no detectable difference at n = 6 (p = 1.00)"


def test_an_unfinished_evaluation_compares_live(api):
    baseline = build(api, "base", {"reach-v3": list("ssff"), "push-v3": list("ssff")})
    candidate = build(api, "cand", {"reach-v3": list("sspp"), "push-v3": list("pppp")}, finalize=False)
    body = compare(api, baseline, candidate)
    assert body["live"] is True
    assert body["candidate"]["unfinished"] == 6 and body["overall"]["pairs"] == 2
    assert body["unpaired_total"] == 6
    assert {u["reason"] for u in body["unpaired"]} == {"the candidate's episode has not finished yet (pending)"}
    assert body["verdict"].endswith("so far")
    assert body["per_task"][1] == {**body["per_task"][1], "task": "push-v3", "pairs": 0, "difference": None,
                                   "ci95": None, "p_value": None}


def test_no_discordant_pairs_and_all_successes(api):
    baseline = build(api, "base", {"reach-v3": list("ssss"), "push-v3": list("ssss")})
    candidate = build(api, "cand", {"reach-v3": list("ssss"), "push-v3": list("ssss")})
    overall = compare(api, baseline, candidate)["overall"]
    assert overall["p_value"] == 1.0 and overall["difference"] == 0
    assert overall["ci95"]["low"] < 0 < overall["ci95"]["high"]


def test_evaluations_of_other_protocols_are_not_comparable(api):
    baseline = build(api, "base", {"reach-v3": list("ss"), "push-v3": list("ss")})
    other_seeds = build(api, "cand", {"reach-v3": list("ss"), "push-v3": list("ss")}, seed=7)
    response = api.client.get("/comparisons", params={"baseline": baseline, "candidate": other_seeds})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "not_comparable"
    assert [d.split(":")[0] for d in error["details"]["differences"]] == ["seeds"]
    assert "seed 0 × 2 episodes per task" in error["message"] and "seed 7" in error["message"]


def test_a_missing_evaluation_is_a_404(api):
    baseline = build(api, "base", {"reach-v3": list("s"), "push-v3": list("s")})
    response = api.client.get("/comparisons", params={"baseline": baseline, "candidate": 999})
    assert response.status_code == 404
    assert "no evaluation with id 999 (the candidate)" in response.json()["error"]["message"]
    assert api.client.get("/comparisons", params={"baseline": baseline}).status_code == 422


def test_the_comparison_page_shows_the_verdict_the_differences_and_both_replays(api):
    baseline = build(api, "base", {"reach-v3": list("sfff"), "push-v3": list("ffff")}, artifacts=True)
    candidate = build(api, "cand", {"reach-v3": list("fsss"), "push-v3": list("ssff")}, artifacts=True)
    body = compare(api, baseline, candidate)
    page = api.client.get("/ui/comparisons", params={"baseline": baseline, "candidate": candidate})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert f"{body['verdict'][0].upper()}{body['verdict'][1:]}" in html
    assert "+50.0 pts" in html  # overall: (5 - 1) / 8
    low, high = body["overall"]["ci95"]["low"], body["overall"]["ci95"]["high"]
    assert f"{100 * low:+.1f} to {100 * high:+.1f}" in html
    assert html.count('class="bar"') == 3 and html.count('class="whisker"') == 3  # overall + 2 tasks
    for pair in body["discordant"]:
        for episode_id in (pair["baseline_episode_id"], pair["candidate_episode_id"]):
            assert f'src="/ui/episodes/{episode_id}/replay.gif"' in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # no external assets
    refused = api.client.get("/ui/comparisons", params={"baseline": baseline, "candidate": 999})
    assert refused.status_code == 404 and "No such evaluation" in refused.text


@pytest.fixture
def served_api(store_engine, monkeypatch):
    for api in make_api(store_engine):
        with serve(api.app) as url:
            monkeypatch.setenv("EVALFORGE_API_URL", url)
            monkeypatch.setenv("EVALFORGE_API_KEY", api.key)
            yield api


def test_eval_compare_prints_the_table_and_the_verdict(served_api, capsys):
    baseline = build(served_api, "base", {"reach-v3": list("sfff"), "push-v3": list("ffff")})
    candidate = build(served_api, "cand", {"reach-v3": list("fsss"), "push-v3": list("ssff")})
    capsys.readouterr()
    assert main(["eval", "compare", str(baseline), str(candidate)]) == 0
    out = capsys.readouterr().out
    reach = next(line for line in out.splitlines() if "reach-v3" in line)
    assert "1 / 3" in reach and "25.0%" in reach and "75.0%" in reach and "+50.0" in reach
    assert "verdict: no detectable difference at n = 8 (p = 0.22)" in out
    assert main(["eval", "compare", str(baseline), str(candidate), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["candidate_only"] == 5
    other = build(served_api, "other", {"reach-v3": list("ss"), "push-v3": list("ss")}, seed=3)
    assert main(["eval", "compare", str(baseline), str(other)]) == 1
    err = capsys.readouterr().err
    assert "not comparable" in err and "seeds:" in err
