"""Policy replicas in the workers: spreading episodes over a policy's servers, failing over when
one dies, coming back to it when it is healthy again.

The rules themselves (``services/workers/replicas.py``) are tested on their own with a clock the
test moves; then end to end with real processes: two `policy-server --engine hf` replicas of one
checkpoint, an `evalforge worker --episodes-in-flight 2` subprocess on PostgreSQL and a dedicated
Redis, one replica SIGKILLed mid-evaluation."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest

from services.queue import CeleryEpisodeQueue
from services.store import queries
from services.store.models import EvaluationStatus, PolicyEndpoint
from services.workers.replicas import ReplicaPool, play_on_replicas
from services.workers.replicas import pool as process_pool
from tests.workers.conftest import (
    MAX_STEPS,
    episodes_of,
    evaluation,
    make_evaluation,
    start_policy_server,
    wait_for,
)
from tests.workers.test_inflight import start_inflight_worker  # noqa: F401  (fixture)

A, B, C = "ws://a:1/ws", "ws://b:1/ws", "ws://c:1/ws"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_least_in_flight_then_fewest_assigned():
    pool = ReplicaPool(clock=Clock())
    first, second, third = (pool.acquire([A, B, C]) for _ in range(3))
    assert [first, second, third] == [A, B, C]  # each has one in flight now
    pool.release(B, "served")
    assert pool.acquire([A, B, C]) == B  # the only one with none in flight
    for endpoint in (A, B, C):
        pool.release(endpoint, "served")
    pool.release(B, "served")
    # none in flight: the fewest given so far (A and C had one, B two) → A, then C
    assert pool.acquire([A, B, C]) == A
    pool.release(A, "served")
    assert pool.acquire([A, B, C]) == C


def test_one_at_a_time_alternates():
    pool = ReplicaPool(clock=Clock())
    served = []
    for _ in range(6):
        endpoint = pool.acquire([A, B])
        served.append(endpoint)
        pool.release(endpoint, "served")
    assert served == [A, B, A, B, A, B]


def test_a_lost_replica_is_skipped_then_probed_and_comes_back():
    clock = Clock()
    pool = ReplicaPool(down_s=1.0, max_down_s=4.0, clock=clock)
    assert pool.acquire([A, B]) == A
    pool.release(A, "lost")
    for _ in range(3):  # down for 1 s: everything goes to B
        endpoint = pool.acquire([A, B])
        assert endpoint == B
        pool.release(B, "served")
    clock.now += 1.01
    assert pool.acquire([A, B]) == A  # the probe (fewer assigned than B)
    pool.release(A, "lost")  # still dead: down for 2 s now
    clock.now += 1.5
    assert pool.healthy([A, B]) == [B]
    clock.now += 0.6
    assert pool.acquire([A, B]) == A
    pool.release(A, "served")  # back
    assert pool.states[A].failures == 0 and pool.healthy([A, B]) == [A, B]
    # doubling stops at max_down_s
    for _ in range(5):
        pool.acquire([A])
        pool.release(A, "lost")
    assert pool.states[A].down_until - clock.now == pytest.approx(4.0)
    # every replica down: the one whose probe is due first still gets the try
    pool.acquire([B])
    pool.release(B, "lost")
    assert pool.acquire([A, B]) == B


def test_an_episodes_own_failure_says_nothing_of_the_server():
    pool = ReplicaPool(clock=Clock())
    pool.acquire([A])
    pool.release(A, "lost")
    pool.acquire([A])
    pool.release(A, "other")
    assert pool.states[A].failures == 1 and pool.states[A].in_flight == 0


class Lost(Exception):
    pass


def test_play_fails_over_at_once_and_raises_only_when_every_replica_failed():
    process_pool.clear()
    dead = {A}
    calls = []

    def play(endpoint: str) -> str:
        calls.append(endpoint)
        if endpoint in dead:
            raise Lost(f"{endpoint} is gone")
        return endpoint

    assert play_on_replicas([A, B], play, Lost) == B
    assert calls == [A, B]
    assert process_pool.states[A].failures == 1 and process_pool.states[B].in_flight == 0
    calls.clear()
    assert play_on_replicas([A, B], play, Lost) == B and calls == [B], "A is skipped while down"
    dead.add(B)
    process_pool.clear()
    with pytest.raises(Lost) as raised:
        play_on_replicas([A, B], play, Lost)
    assert raised.value.endpoint == B and calls[-2:] == [A, B]

    def refuses(endpoint: str) -> str:
        raise ValueError("bad actions")  # the episode's fault: no failover, the replica stays healthy

    process_pool.clear()
    with pytest.raises(ValueError) as raised:
        play_on_replicas([A, B], refuses, Lost)
    assert raised.value.endpoint == A and process_pool.healthy([A, B]) == [A, B]
    process_pool.clear()


# ---------------------------------------------------------------------------- real processes


def _infers(server) -> int:
    """How many inference requests the policy server at ``server`` has answered (its /metrics)."""
    text = urllib.request.urlopen(f"{server.http_url}/metrics", timeout=5).read().decode()
    match = re.search(r'^evalforge_policy_requests_total\{type="infer"\} ([0-9.e+]+)$', text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def _add_replica(sessions, evaluation_id: int, endpoint: str) -> None:
    with sessions() as session:
        policy_id = queries.get_evaluation(session, evaluation_id).policy_id
        if not session.query(PolicyEndpoint).filter_by(policy_id=policy_id, endpoint=endpoint).first():
            queries.add_policy_endpoint(session, queries.get_policy(session, policy_id), endpoint)


def _assert_no_failures(sessions, evaluation_id: int, count: int) -> None:
    rows = episodes_of(sessions, evaluation_id)
    assert sorted(r.episode_index for r in rows) == list(range(count))
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None and r.steps == MAX_STEPS
               for r in rows), [(r.episode_index, r.status, r.failure_reason, (r.error_message or "")[:300])
                                for r in rows]
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
def test_a_replica_killed_mid_evaluation_loses_no_episode_and_comes_back(
        sessions, reach_checkpoint, redis_server, start_inflight_worker, tmp_path):  # noqa: F811
    count = 12
    first = start_policy_server(reach_checkpoint, tmp_path)
    second = start_policy_server(reach_checkpoint, tmp_path)
    try:
        evaluation_id, ids = make_evaluation(sessions, first.ws_url, count)
        _add_replica(sessions, evaluation_id, second.ws_url)
        # Retries that would run out within seconds were the replicas not failed over between.
        worker = start_inflight_worker(redis_server.url, "replicas", 2, policy_retries=1, policy_backoff_s=0.5,
                              policy_backoff_max_s=1.0, policy_connect_deadline_s=1.0,
                              seconds_per_step=5.0)  # a shared CPU: the time limits are not what is tested
        CeleryEpisodeQueue(redis_server.url).enqueue(ids)
        wait_for(lambda: _infers(first) > 0 and _infers(second) > 0
                 and sum(r.status != "pending" for r in episodes_of(sessions, evaluation_id)) >= 3, 60,
                 "both replicas to serve episodes")
        served_by_first = _infers(first)
        first.stop(signal.SIGKILL)  # mid-evaluation: with two episodes in flight, one is on it
        wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 120, "the evaluation to finish")
        _assert_no_failures(sessions, evaluation_id, count)
        assert served_by_first > 0 and _infers(second) > 0
        assert f"failing over to {second.ws_url}" in worker.log(200_000), worker.log()
        assert all(r.attempts == 1 for r in episodes_of(sessions, evaluation_id)), \
            "failing over happens within the episode's claim, not through the sweeper"

        # The replica comes back on its port: the next evaluation's episodes go to it again.
        first = start_policy_server(reach_checkpoint, tmp_path, port=first.port)
        again_id, again_ids = make_evaluation(sessions, first.ws_url, 6)
        CeleryEpisodeQueue(redis_server.url).enqueue(again_ids)
        wait_for(lambda: evaluation(sessions, again_id).finalised, 120, "the second evaluation to finish")
        _assert_no_failures(sessions, again_id, 6)
        assert _infers(first) > 0, "the restarted replica got episodes again"
    finally:
        first.stop()
        second.stop()
