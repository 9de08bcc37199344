"""``/evaluations`` end to end on SQLite and PostgreSQL: submit, validate, idempotency, list,
detail with results, episodes, cancel — with the store's worker-side queries playing the workers."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from benchmarks.suite import evaluation_seed
from services.store import queries
from services.store.aggregates import wilson_interval
from services.store.models import Episode
from tests.eval_api.conftest import MT10_TASKS


def play(api, evaluation_id: int, outcome) -> None:
    """Claim and finish every pending episode of an evaluation; ``outcome(episode) -> finish kwargs``."""
    with api.sessions() as session:
        episodes = session.scalars(select(Episode).where(Episode.evaluation_id == evaluation_id)
                                   .order_by(Episode.episode_index)).all()
        for episode in episodes:
            if queries.claim_episode(session, episode.id, "worker-1", 60):
                queries.finish_episode(session, episode.id, **outcome(episode))
        queries.finalize_evaluation_if_done(session, evaluation_id)


def test_submit_stores_every_episode_and_enqueues_after_commit(api):
    policy = api.register_policy()
    visible_when_sent = []
    record = api.queue.enqueue

    def enqueue_seeing_what_is_committed(episode_ids, simulator=None):
        # A session of its own sees only committed rows: every episode must already be there.
        with api.sessions() as other:
            visible_when_sent.append(set(other.scalars(select(Episode.id).where(Episode.id.in_(episode_ids)))))
        return record(episode_ids, simulator)

    api.queue.enqueue = enqueue_seeing_what_is_committed
    response = api.client.post("/evaluations", headers=api.auth, json={
        "policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 3, "seed": 7,
        "tags": ["nightly", "baseline"]})
    assert response.status_code == 202, response.text
    body = response.json()
    assert response.headers["Location"] == f"/evaluations/{body['id']}"
    assert body["status"] == "pending" and body["episodes_total"] == 30 and body["standard"] is True
    assert body["tasks"] == list(MT10_TASKS) and body["tags"] == ["baseline", "nightly"]
    assert body["policy"]["id"] == policy["id"] and body["policy"]["checkpoint_sha256"] == "ab" * 32
    assert body["counts"] == {"pending": 30, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    assert [row["task"] for row in body["per_task"]] == list(MT10_TASKS)
    assert body["overall"]["success_rate"] is None and body["overall"]["ci95"] is None

    with api.sessions() as session:
        episodes = session.scalars(select(Episode).order_by(Episode.episode_index)).all()
    assert len(episodes) == 30 and {e.status for e in episodes} == {"pending"}
    # Task-major; episode i of each task runs evaluation seed (7 + i), never a demonstration seed.
    assert [(e.task, e.seed, e.max_steps) for e in episodes] == \
        [(task, evaluation_seed(7 + i), 500) for task in MT10_TASKS for i in range(3)]
    assert api.queue.sent == [e.id for e in episodes]
    assert set(api.queue.queues) == {"metaworld"}, "on the queue of the suite's simulator family"
    assert visible_when_sent == [{e.id for e in episodes}]

    detail = api.client.get(f"/evaluations/{body['id']}").json()
    assert detail["counts"]["pending"] == 30 and detail["id"] == body["id"]


def test_subset_and_step_limit_make_a_nonstandard_evaluation(api):
    policy = api.register_policy()
    body = api.submit(policy["id"], tasks=["push-v3", "reach-v3"], max_steps=100, episodes_per_task=1)
    assert body["tasks"] == ["push-v3", "reach-v3"] and body["standard"] is False and body["max_steps"] == 100
    with api.sessions() as session:
        assert {e.max_steps for e in session.scalars(select(Episode))} == {100}


@pytest.mark.parametrize(("change", "code", "fragment"), [
    ({"suite": "metaworld-mt11"}, "unknown_suite", "did you mean: metaworld-mt10"),
    ({"tasks": ["reach-v3", "rech-v3"]}, "unknown_task", "did you mean: reach-v3"),
    ({"episodes_per_task": 201}, "too_many_episodes", "10 task(s) × 201 episodes = 2010 episodes"),
    ({"seed": -1}, "validation_error", "seed"),
    ({"episodes_per_task": 0}, "validation_error", "episodes_per_task"),
    ({"surprise": 1}, "validation_error", "surprise"),
    ({"seed": 1.5}, "validation_error", "seed"),
    ({"seed": "3"}, "validation_error", "seed"),
    ({"tasks": []}, "validation_error", "tasks"),
    ({"tasks": ["reach-v3", "reach-v3"]}, "validation_error", "repeated: reach-v3"),
    ({"tags": ["has space"]}, "validation_error", "tags"),
    ({"suite": "metaworld\x00mt10"}, "validation_error", "suite"),
    ({"max_steps": 501}, "invalid_max_steps", "exceeds the step limit"),
    ({"policy_id": 9999}, "unknown_policy", "POST /policies"),
    ({"policy_id": 2**70}, "validation_error", "policy_id"),
])
def test_bad_submissions_are_422_naming_the_problem(api, change, code, fragment):
    policy = api.register_policy()
    body = {"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 2, "seed": 0, **change}
    response = api.client.post("/evaluations", json=body, headers=api.auth)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == code and fragment in error["message"], error
    assert api.queue.sent == []


def test_policy_must_fit_the_suite(api):
    small = api.register_policy("pusht-policy", "ws://pusht.test/ws", tasks=("push-t",), state_dim=5,
                                action_dim=2)
    error = api.submit(small["id"], expect=422)["error"]
    assert error["code"] == "incompatible_policy" and "5/2 but suite metaworld-mt10 needs 39/4" in error["message"]
    partial = api.register_policy("reach-only", "ws://reach.test/ws", tasks=("reach-v3", "push-v3"))
    error = api.submit(partial["id"], expect=422)["error"]
    assert error["code"] == "incompatible_policy" and "pass `tasks` with those it knows (reach-v3, push-v3)" \
        in error["message"]
    assert len(error["details"]["missing_tasks"]) == 8
    assert api.submit(partial["id"], tasks=["reach-v3"])["episodes_total"] == 2


def test_idempotency_key(api):
    policy = api.register_policy()
    key = {"Idempotency-Key": "submit-7f3a"}
    first = api.client.post("/evaluations", headers={**api.auth, **key},
                            json={"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 2})
    again = api.client.post("/evaluations", headers={**api.auth, **key},
                            json={"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 2,
                                  "seed": 0, "tags": []})  # the same request, defaults spelled out
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert len(api.queue.sent) == 20  # enqueued once

    other = api.client.post("/evaluations", headers={**api.auth, **key},
                            json={"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 3})
    assert other.status_code == 409
    error = other.json()["error"]
    assert error["code"] == "idempotency_conflict" and error["details"]["evaluation_id"] == first.json()["id"]
    assert api.client.get("/evaluations").json()["items"].__len__() == 1
    bad_key = api.client.post("/evaluations", headers={**api.auth, "Idempotency-Key": "x" * 256},
                              json={"policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 1})
    assert bad_key.status_code == 422


def test_list_filters_and_cursor_pagination(api):
    a = api.register_policy("a", "ws://a.test/ws")
    b = api.register_policy("b", "ws://b.test/ws", tasks=MT10_TASKS + ("push-t",))
    ids = []
    for i in range(7):
        policy = a if i % 2 == 0 else b
        ids.append(api.submit(policy["id"], episodes_per_task=1, tags=["nightly"] if i % 3 == 0 else [])["id"])
    newest_first = ids[::-1]

    seen, cursor = [], None
    while True:
        page = api.client.get("/evaluations", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == newest_first

    def ids_for(**params):
        return [item["id"] for item in api.client.get("/evaluations", params=params).json()["items"]]

    assert ids_for(policy_id=a["id"]) == [i for n, i in enumerate(ids) if n % 2 == 0][::-1]
    assert ids_for(tag="nightly") == [ids[6], ids[3], ids[0]]
    assert ids_for(tag="nightly", policy_id=b["id"]) == [ids[3]]
    assert ids_for(suite="metaworld-mt10", status="pending") == newest_first
    assert ids_for(status="finished") == [] and ids_for(suite="pusht") == []

    for params, code in (({"cursor": "bm9wZQ"}, "invalid_cursor"), ({"limit": 501}, "validation_error"),
                         ({"status": "sleeping"}, "validation_error"), ({"limit": 0}, "validation_error")):
        response = api.client.get("/evaluations", params=params)
        assert response.status_code == 422 and response.json()["error"]["code"] == code, params
    episode_cursor = api.client.get(f"/evaluations/{ids[0]}/episodes", params={"limit": 1}).json()["next_cursor"]
    response = api.client.get("/evaluations", params={"cursor": episode_cursor})
    assert response.json()["error"]["code"] == "invalid_cursor"


def test_detail_reports_live_then_final_results(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3", "push-v3"], episodes_per_task=5)
    # reach: 4 of 5 succeed; push: 2 succeed, 1 policy timeout, 1 env error (not scored), 1 out of steps.
    push_outcomes = [dict(success=True, steps=80), dict(success=True, steps=120),
                     dict(success=False, steps=30, failure_reason="policy_timeout"),
                     dict(success=False, steps=3, failure_reason="env_error", error_message="mujoco: unstable"),
                     dict(success=False, steps=500)]

    def outcome(episode):
        common = dict(total_return=1.0, duration_s=2.0, latency_mean_ms=10.0 + episode.episode_index,
                      latency_p95_ms=20.0 + episode.episode_index)
        if episode.task == "reach-v3":
            return {**common, **(dict(success=True, steps=50) if episode.episode_index < 4
                                 else dict(success=False, steps=500))}
        return {**common, **push_outcomes[episode.episode_index - 5]}

    with api.sessions() as session:  # two episodes still running: live results
        first = session.scalars(select(Episode).order_by(Episode.episode_index)).all()[:2]
        for episode in first:
            queries.claim_episode(session, episode.id, "w", 60)
    live = api.client.get(f"/evaluations/{evaluation['id']}").json()
    assert live["status"] == "running" and live["counts"]["running"] == 2 and live["counts"]["pending"] == 8
    assert live["finished_at"] is None and live["success_rate"] is None

    with api.sessions() as session:
        for episode in first:
            queries.finish_episode(session, episode.id, **outcome(episode))
    play(api, evaluation["id"], outcome)

    detail = api.client.get(f"/evaluations/{evaluation['id']}").json()
    assert detail["status"] == "finished" and detail["finished_at"] is not None
    assert detail["counts"] == {"pending": 0, "running": 0, "succeeded": 6, "failed": 4, "cancelled": 0}
    per_task = {row["task"]: row for row in detail["per_task"]}
    reach, push, overall = per_task["reach-v3"], per_task["push-v3"], detail["overall"]
    assert (reach["scored"], reach["succeeded"], reach["success_rate"]) == (5, 4, 0.8)
    assert reach["ci95"] == pytest.approx(dict(zip(("low", "high"), wilson_interval(4, 5), strict=True)))
    assert reach["mean_steps"] == pytest.approx((4 * 50 + 500) / 5)
    assert (push["scored"], push["succeeded"]) == (4, 2)
    assert push["failure_reasons"] == {"env_error": 1, "policy_timeout": 1}
    assert (overall["scored"], overall["succeeded"]) == (9, 6)
    assert detail["success_rate"] == pytest.approx(6 / 9) == overall["success_rate"]
    assert overall["ci95"]["low"] == pytest.approx(wilson_interval(6, 9)[0])
    assert overall["latency_ms"]["p50"] == pytest.approx(14.5)  # median of 10..19
    assert overall["latency_ms"]["p95"] == pytest.approx(29 - 0.45)  # 95th pct of 20..29

    assert api.client.get("/evaluations/424242").status_code == 404
    assert api.client.get("/evaluations/424242").json()["error"]["code"] == "not_found"
    assert api.client.get(f"/evaluations/{2**64}").status_code == 422
    assert api.client.get("/evaluations/abc").status_code == 422


def test_episodes_are_paginated_in_index_order(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3", "push-v3"], episodes_per_task=10)
    indexes, cursor = [], None
    while True:
        params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
        page = api.client.get(f"/evaluations/{evaluation['id']}/episodes", params=params).json()
        indexes += [item["episode_index"] for item in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert indexes == list(range(20))
    play(api, evaluation["id"], lambda e: dict(success=e.episode_index % 4 == 0, steps=10))
    page = api.client.get(f"/evaluations/{evaluation['id']}/episodes", params={"status": "succeeded"}).json()
    assert [item["episode_index"] for item in page["items"]] == [0, 4, 8, 12, 16]
    item = page["items"][0]
    assert item["attempts"] == 1 and item["worker_id"] == "worker-1" and item["seed"] == evaluation_seed(0)
    assert api.client.get("/evaluations/999/episodes").status_code == 404


def test_cancel(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=4)
    with api.sessions() as session:
        running = session.scalars(select(Episode).order_by(Episode.episode_index)).first()
        queries.claim_episode(session, running.id, "w", 60)
    response = api.client.post(f"/evaluations/{evaluation['id']}/cancel", headers=api.auth)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "cancelled" and body["counts"] == {
        "pending": 0, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 3}
    assert body["overall"]["failure_reasons"] == {"cancelled": 3}
    assert api.client.post(f"/evaluations/{evaluation['id']}/cancel", headers=api.auth).status_code == 200

    done = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=1)
    play(api, done["id"], lambda e: dict(success=True, steps=5))
    response = api.client.post(f"/evaluations/{done['id']}/cancel", headers=api.auth)
    assert response.status_code == 409 and response.json()["error"]["code"] == "evaluation_finished"
    assert "already finished" in response.json()["error"]["message"]
    assert api.client.post("/evaluations/31337/cancel", headers=api.auth).status_code == 404


@pytest.fixture
def capped_api(store_engine):
    from tests.eval_api.conftest import make_api
    yield from make_api(store_engine, max_queued_episodes=50)


def test_queued_episodes_are_capped_in_the_store(capped_api):
    """Past EVALFORGE_MAX_QUEUED_EPISODES a submission is a 429 naming the cap; once workers take
    episodes off the queue there is room again. Counted in the store, whatever the broker holds."""
    api = capped_api
    policy = api.register_policy()
    first = api.submit(policy["id"], episodes_per_task=4)  # 40 pending
    refused = api.client.post("/evaluations", headers=api.auth, json={
        "policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 2, "seed": 1})  # +20 > 50
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "50" in error["message"]
    assert "EVALFORGE_MAX_QUEUED_EPISODES" in error["message"] and refused.headers["Retry-After"]
    assert error["details"] == {"queued_episodes": 40, "new_episodes": 20, "max_queued_episodes": 50}
    assert len(api.queue.sent) == 40  # nothing of the refused one was stored or enqueued
    api.submit(policy["id"], episodes_per_task=1, seed=2)  # +10 = 50: at the cap, accepted
    play(api, first["id"], lambda episode: {"success": True, "steps": 5})
    api.submit(policy["id"], episodes_per_task=2, seed=3)  # 10 + 20 after the workers ran 40


@pytest.mark.parametrize("body", ["{", '{"policy_id": "x"}', '{"suite": 5}', "[]"])
@pytest.mark.parametrize("path", ["/evaluations", "/policies"])
def test_a_malformed_body_without_a_key_is_401_not_422(api, path, body):
    """Authentication first: a request without a key is told it needs one, whatever its body."""
    response = api.client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "unauthorized" and response.headers["WWW-Authenticate"] == "Bearer"
    with_key = api.client.post(path, content=body, headers={**api.auth, "Content-Type": "application/json"})
    assert with_key.status_code == 422, with_key.text


def test_an_evaluation_that_is_mostly_harness_failures_is_not_ranked_and_says_why(api):
    """Most episodes never said anything about the policy (harness failures): finished, but left off
    the leaderboard, and its detail says why. A few harness failures do not unrank an evaluation."""
    broken_policy = api.register_policy("broken", "ws://broken.test/ws")
    fine_policy = api.register_policy("fine", "ws://fine.test/ws")
    broken = api.submit(broken_policy["id"], episodes_per_task=2)  # 20 episodes: 11 env_error, 9 scored
    fine = api.submit(fine_policy["id"], episodes_per_task=2)  # 20 episodes: 2 env_error, 18 scored (0%)

    def outcome(harness_failures: int):
        def finish(episode):
            index = episode.episode_index
            if index < harness_failures:
                return {"success": False, "failure_reason": "env_error", "error_message": "simulator crashed"}
            return {"success": True, "steps": 5} if harness_failures > 5 else {"success": False, "steps": 500}
        return finish

    play(api, broken["id"], outcome(11))
    play(api, fine["id"], outcome(2))
    broken_detail = api.client.get(f"/evaluations/{broken['id']}").json()
    assert broken_detail["status"] == "finished" and broken_detail["overall"]["success_rate"] == 1.0
    reason = broken_detail["unranked_reason"]
    assert reason and "11 of 20" in reason and "env_error: 11" in reason and "not ranked" in reason
    fine_detail = api.client.get(f"/evaluations/{fine['id']}").json()
    assert fine_detail["unranked_reason"] is None
    board = api.client.get("/leaderboard", params={"suite": "metaworld-mt10"}).json()["entries"]
    assert [entry["evaluation_id"] for entry in board] == [fine["id"]]  # 100% on 9 episodes is not ranked
    page = api.client.get(f"/ui/evaluations/{broken['id']}").text
    assert reason in page  # the page says it too
    assert 'id="unranked"' not in api.client.get(f"/ui/evaluations/{fine['id']}").text
