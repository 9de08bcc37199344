"""Determinism with real processes (issue #22): an evaluation's per-episode outcomes do not depend on
how many workers ran it, in which order, or on a worker dying mid-episode and the episode being run
again. The same seeds are evaluated three times against the deterministic ``policy-server --engine hf``
— one worker, one worker running three episodes at a time, and a worker SIGKILLed mid-run then a
rescuer with the sweeper — and every (task, seed) must end with the same (success, steps)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.queue import CeleryEpisodeQueue
from services.store.models import EvaluationStatus
from tests.workers.conftest import episodes_of, evaluation, make_evaluation, wait_for
from tests.workers.test_faults import _running_sweeper

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

EPISODES = 4
STEPS = 150  # long enough that the kill lands mid-episode, short enough for three runs in well under 90 s


def _outcomes(sessions, evaluation_id: int) -> dict[tuple[str, int], tuple[bool | None, int | None]]:
    """(task, seed) → (success, steps) of a finished evaluation, after checking that it finished."""
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    rows = episodes_of(sessions, evaluation_id)
    assert [r.status for r in rows if r.status not in ("succeeded", "failed")] == []
    return {(r.task, r.seed): (r.success, r.steps) for r in rows}


def test_outcomes_do_not_depend_on_worker_count_order_or_retries(sessions, policy_server, redis_server,
                                                                  start_worker):
    queue = CeleryEpisodeQueue(redis_server.url)

    one_id, ids = make_evaluation(sessions, policy_server.ws_url, EPISODES, max_steps=STEPS)
    single = start_worker(redis_server.url, "single")
    queue.enqueue(ids)
    wait_for(lambda: evaluation(sessions, one_id).finalised, 60, "the one-worker evaluation to finish")
    single.stop()
    reference = _outcomes(sessions, one_id)
    assert len(reference) == EPISODES

    three_id, ids = make_evaluation(sessions, policy_server.ws_url, EPISODES, max_steps=STEPS)
    parallel = start_worker(redis_server.url, "parallel", concurrency=3)
    queue.enqueue(list(reversed(ids)))  # another order too
    wait_for(lambda: evaluation(sessions, three_id).finalised, 60, "the three-slot evaluation to finish")
    parallel.stop()
    assert _outcomes(sessions, three_id) == reference

    killed_id, ids = make_evaluation(sessions, policy_server.ws_url, EPISODES, max_steps=STEPS)
    victim = start_worker(redis_server.url, "victim")
    queue.enqueue(ids)
    wait_for(lambda: any(r.status == "running" for r in episodes_of(sessions, killed_id)), 30,
             "an episode to start")
    time.sleep(0.3)  # mid-episode
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    killed = [r.id for r in episodes_of(sessions, killed_id) if r.status == "running"]
    assert len(killed) == 1  # the kill landed mid-episode: that episode is run again from its seed
    start_worker(redis_server.url, "rescuer")
    with _running_sweeper(sessions, redis_server.url):
        wait_for(lambda: evaluation(sessions, killed_id).finalised, 60, "the evaluation to finish")
    again = next(r for r in episodes_of(sessions, killed_id) if r.id == killed[0])
    assert again.attempts == 2
    assert _outcomes(sessions, killed_id) == reference
