"""Provenance through the API: the protocol an evaluation records and shows, episode hosts, leaderboard versions."""

from __future__ import annotations

import io
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from rich.console import Console
from sqlalchemy import update

from benchmarks.registry import evaluation_seed, get_suite
from services.cli.render import print_results
from services.eval_api.schemas import EvaluationDetail
from services.store.models import Evaluation
from tests.eval_api.conftest import MT10_TASKS
from tests.eval_api.test_evaluations import play

REPO = Path(__file__).resolve().parents[2]
MT10_HASH = get_suite("metaworld-mt10").definition_hash()


def _finished(api, policy_id: int, successes: int, **body) -> int:
    evaluation = api.submit(policy_id, episodes_per_task=2, **body)
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index < successes, steps=5, worker_host="node-7",
                                               renderer="egl", simulator_versions={"metaworld": "3.1.1"}))
    return evaluation["id"]


def test_an_evaluation_records_and_shows_the_protocol_that_produced_it(api):
    policy = api.register_policy(cameras={"corner": (96, 96)})
    created = api.submit(policy["id"], seed=40, max_steps=150, tasks=["reach-v3", "push-v3"],
                         inference={"action_horizon": 2})
    protocol = created["protocol"]
    assert protocol == api.client.get(f"/evaluations/{created['id']}").json()["protocol"]
    assert protocol["suite"] == "metaworld-mt10" and protocol["simulator"] == "metaworld"
    assert protocol["definition_hash"] == MT10_HASH
    assert protocol["tasks"] == [{"name": "reach-v3", "max_steps": 150}, {"name": "push-v3", "max_steps": 150}]
    assert protocol["seeds"] == {"seed": 40, "episodes_per_task": 2, "first_seed": evaluation_seed(40),
                                 "rule": get_suite("metaworld-mt10").seed_rule}
    assert protocol["cameras"] == {"corner": [96, 96]}
    assert protocol["inference"] == {"action_horizon": 2, "temporal_ensemble": None}
    assert protocol["policy"] == {"id": policy["id"], "name": "bc", "version": policy["version"],
                                  "protocol": "evalforge", "checkpoint_sha256": "ab" * 32, "revision": None}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    assert protocol["evalforge"] == {"version": metadata.version("evalforge"), "source_commit": head or None}
    listed = api.client.get("/evaluations").json()["items"]
    assert [item["protocol"] for item in listed] == [protocol]
    with api.sessions() as session:
        assert session.get(Evaluation, created["id"]).definition_hash == MT10_HASH
    default = api.submit(policy["id"])["protocol"]  # every task at its own limit, the default inference
    assert [(t["name"], t["max_steps"]) for t in default["tasks"]] == [
        (task.name, task.max_steps) for task in get_suite("metaworld-mt10").tasks]
    assert default["inference"] == {"action_horizon": None, "temporal_ensemble": None}


def test_episodes_show_their_worker_host_and_renderer(api):
    evaluation_id = _finished(api, api.register_policy()["id"], 1)
    episodes = api.client.get(f"/evaluations/{evaluation_id}/episodes").json()["items"]
    assert {(e["worker_host"], e["renderer"]) for e in episodes} == {("node-7", "egl")}
    assert {tuple(e["simulator_versions"].items()) for e in episodes} == {(("metaworld", "3.1.1"),)}


def test_an_evaluation_from_before_protocols_reads_with_a_null_protocol(api):
    created = api.submit(api.register_policy()["id"])
    with api.sessions() as session:
        session.execute(update(Evaluation).where(Evaluation.id == created["id"])
                        .values(protocol=None, definition_hash=None))
        session.commit()
    shown = api.client.get(f"/evaluations/{created['id']}")
    assert shown.status_code == 200 and shown.json()["protocol"] is None
    page = api.client.get(f"/ui/evaluations/{created['id']}").text
    assert "made before EvalForge recorded protocols" in page


def test_the_leaderboard_ranks_the_current_definition_and_shows_older_ones_on_request(api):
    old, new, legacy = (api.register_policy(name, f"ws://{name}.test/ws")["id"] for name in ("old", "new", "legacy"))
    old_id = _finished(api, old, 4)
    new_id = _finished(api, new, 1)
    legacy_id = _finished(api, legacy, 4)
    older = "0" * 64
    with api.sessions() as session:  # as if the suite's definition changed after these two ran
        session.execute(update(Evaluation).where(Evaluation.id == old_id).values(definition_hash=older))
        session.execute(update(Evaluation).where(Evaluation.id == legacy_id).values(definition_hash=None))
        session.commit()

    board = api.client.get("/leaderboard", params={"suite": "metaworld-mt10"}).json()
    assert board["definition_hash"] == MT10_HASH and board["current_definition"] is True
    assert [e["evaluation_id"] for e in board["entries"]] == [new_id]

    past = api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "definition": older}).json()
    assert past["definition_hash"] == older and past["current_definition"] is False
    assert [e["evaluation_id"] for e in past["entries"]] == [old_id]

    unknown = api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "definition": "1" * 64})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_definition"
    assert MT10_HASH in unknown.json()["error"]["message"]
    malformed = api.client.get("/leaderboard", params={"suite": "metaworld-mt10", "definition": "abc"})
    assert malformed.status_code == 422
    # The current definition with nothing on it yet is an empty board, not an error.
    pusht = api.client.get("/leaderboard", params={"suite": "pusht"}).json()
    assert pusht["entries"] == [] and pusht["definition_hash"] == get_suite("pusht").definition_hash()


def test_the_page_and_the_cli_show_the_provenance(api):
    evaluation_id = _finished(api, api.register_policy()["id"], 2, inference={"action_horizon": 1})
    page = api.client.get(f"/ui/evaluations/{evaluation_id}").text
    assert f'<code id="definition-hash">{MT10_HASH}</code>' in page
    assert f"{len(MT10_TASKS)} tasks, at most 500 steps each" in page
    assert '<dd id="provenance-inference">horizon 1</dd>' in page
    assert "metaworld 3.1.1, rendered with egl" in page and '<dd id="provenance-hosts">node-7</dd>' in page
    assert metadata.version("evalforge") in page
    assert '<p id="recording">Recorded rollouts: none' in page
    recorded = _finished(api, api.register_policy(name="recorded")["id"], 1, record="failures")
    page = api.client.get(f"/ui/evaluations/{recorded}").text
    assert f'<code>failures</code> — <a href="/evaluations/{recorded}/dataset">' in page

    report = EvaluationDetail.model_validate(api.client.get(f"/evaluations/{evaluation_id}").json())
    out = io.StringIO()
    print_results(report, Console(file=out, width=200))
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith(f"provenance: suite definition {MT10_HASH[:12]} · horizon 1 · policy evalforge "
                           f"{'ab' * 6} · evalforge {metadata.version('evalforge')}")


@pytest.mark.parametrize("change", [{"seed": 1}, {"inference": {"action_horizon": 1}}, {"tasks": ["reach-v3"]}])
def test_protocol_differences_of_evaluations_made_through_the_api(api, change):
    from services.store.provenance import protocol_differences

    policy = api.register_policy()["id"]
    same = [api.submit(policy)["id"], api.submit(policy)["id"]]
    other = api.submit(policy, **change)["id"]
    with api.sessions() as session:
        a, b, c = (session.get(Evaluation, i) for i in (*same, other))
        assert protocol_differences(a, b) == []
        assert len(protocol_differences(a, c)) == 1
