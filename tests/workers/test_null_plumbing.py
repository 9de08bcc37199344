"""The plumbing alone (issue #23): the ``null`` suite against ``policy-server --engine null``, played by a
real ``evalforge worker --episodes-in-flight 8`` off a real Redis, on PostgreSQL. Thousands of
episodes published by the pipelined producer (several chunks) each end exactly once, as their seed
says, and the queue is left empty."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from benchmarks.null import MAX_STEPS, seeded_success
from services.protocol.client import PolicyClient
from services.queue import PUBLISH_CHUNK, CeleryEpisodeQueue, queue_name
from services.store import queries
from services.store.models import EvaluationStatus
from services.supervisor import PolicyServerProcess
from tests.workers.conftest import episodes_of, evaluation, wait_for
from tests.workers.test_inflight import start_inflight_worker  # noqa: F401  (fixture)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

EPISODES = 2 * PUBLISH_CHUNK + 500


@pytest.fixture(scope="module")
def null_server(tmp_path_factory):
    from policy_format import checkpoint_digest
    from trainer.cli import main as trainer_main

    out = tmp_path_factory.mktemp("null") / "policy"
    trainer_main(["init-policy", "--suite", "null", "--out", str(out), "--force"])
    server = PolicyServerProcess(out, "--engine", "null", log_dir=out.parent).start(60)
    yield server, checkpoint_digest(out)
    server.stop()


def test_null_engine_answers_zero_actions(null_server):
    server, _ = null_server
    client = PolicyClient(server.ws_url)
    try:
        actions = np.asarray(client.infer({"state": np.zeros(4, dtype=np.float32), "task": "null"}).actions)
    finally:
        client.close()
    assert actions.shape == (4, 2)
    assert np.abs(actions).max() <= 2.0 / 256 + 1e-6  # the bin nearest zero of [-1, 1] in 256 bins


def test_thousands_of_null_episodes_each_end_once(sessions, null_server, redis_server, start_inflight_worker):  # noqa: F811
    server, sha = null_server
    with sessions() as session:
        policy = queries.create_policy(session, name="null", version="v1", endpoint=server.ws_url,
                                       checkpoint_sha256=sha, state_dim=4, action_dim=2, chunk_size=4,
                                       tasks=["null"])
        specs = [queries.EpisodeSpec(task="null", seed=1_000_000 + i, max_steps=MAX_STEPS) for i in range(EPISODES)]
        created = queries.create_evaluation(session, policy_id=policy.id, suite="null", tasks=["null"],
                                            episodes_per_task=EPISODES, seed=0, max_steps=None, standard=False,
                                            tags=[], episodes=specs)
        evaluation_id, ids = created.evaluation.id, created.episode_ids
    queue = CeleryEpisodeQueue(redis_server.url)
    assert queue.enqueue(ids, "null") == EPISODES
    broker = redis.Redis.from_url(redis_server.url)
    assert broker.llen(queue_name("null")) == EPISODES  # every episode queued, before any worker runs

    start_inflight_worker(redis_server.url, "null", 8, replay_episodes=0, simulators="null")
    wait_for(lambda: evaluation(sessions, evaluation_id).finalised, 240, "the null evaluation to finish", step=0.5)
    rows = episodes_of(sessions, evaluation_id)
    assert evaluation(sessions, evaluation_id).status == EvaluationStatus.FINISHED
    assert len(rows) == EPISODES and {r.attempts for r in rows} == {1}
    assert all(r.failure_reason is None and r.steps == MAX_STEPS for r in rows)
    assert [r.success for r in rows] == [seeded_success("null", r.seed) for r in rows]
    assert broker.llen(queue_name("null")) == 0
