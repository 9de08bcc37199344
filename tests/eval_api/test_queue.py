"""Enqueueing with the real Celery producer and Redis: one message per episode lands on the
``episodes`` queue, in the format the workers' Celery app consumes."""

from __future__ import annotations

import base64
import json
import secrets

import pytest
import redis

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.queue import RUN_EPISODE_TASK, CeleryEpisodeQueue, QueueSettings, embedded_broker_url
from services.workers.celery_app import make_celery_app
from tests.eval_api.conftest import Api, ScriptedHandshake, metadata


def test_the_producer_and_the_workers_read_one_queue_contract():
    from services.workers.celery_app import app as worker_app
    from services.workers.tasks import run_episode

    queue_settings = QueueSettings(redis_url="redis://127.0.0.1:1/0", episode_queue="episodes-a",
                                   visibility_timeout_s=120)
    producer = CeleryEpisodeQueue.from_settings(queue_settings)
    conf = make_celery_app(queue_settings).conf
    # The task the workers register is the one the producer sends, on the queue both read.
    assert run_episode.name == RUN_EPISODE_TASK == "evalforge.run_episode" and RUN_EPISODE_TASK in worker_app.tasks
    assert producer.queue == conf.task_default_queue == "episodes-a"
    assert conf.task_routes[RUN_EPISODE_TASK] == {"queue": "episodes-a"}
    assert producer.broker_url == conf.broker_url == "redis://127.0.0.1:1/0"
    assert conf.broker_transport_options["visibility_timeout"] == 120
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.task_serializer == "json" and conf.accept_content == ["json"]


def test_queue_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("REDIS_URL", "redis://cache.test:6379/3")
    monkeypatch.setenv("EVALFORGE_EPISODE_QUEUE", "episodes-b")
    assert (QueueSettings().effective_broker_url, QueueSettings().episode_queue) == (
        "redis://cache.test:6379/3", "episodes-b")
    monkeypatch.setenv("EVALFORGE_BROKER_URL", embedded_broker_url(tmp_path / "broker"))
    assert QueueSettings().effective_broker_url == f"filesystem://{(tmp_path / 'broker').resolve()}"


def test_a_dead_broker_fails_fast():
    queue = CeleryEpisodeQueue("redis://127.0.0.1:1/0", timeout_s=0.5)
    assert queue.enqueue([1, 2, 3]) == 0
    with pytest.raises(Exception):  # noqa: B017 - kombu raises its own OperationalError
        queue.ping()


@pytest.fixture
def broker(redis_url):
    """The test Redis DB (``TEST_REDIS_URL``, DB 15 by default) and a queue name of this test's own,
    so parallel test runs on one Redis never see each other's messages."""
    client = redis.Redis.from_url(redis_url)
    queue = f"episodes-test-{secrets.token_hex(4)}"
    yield client, queue
    client.delete(*(client.keys(f"*{queue}*") or [queue]))
    client.close()


@pytest.mark.redis
def test_submitted_episodes_land_in_the_redis_queue(store_engine, broker, redis_url):
    from fastapi.testclient import TestClient

    from services.store.api_keys import create_api_key
    from services.store.db import make_session_factory

    broker, queue_name = broker
    queue = CeleryEpisodeQueue(redis_url, queue_name)
    handshake = ScriptedHandshake({"ws://p.test/ws": metadata()})
    app = create_app(ApiSettings(), engine=store_engine, episode_queue=queue, handshake=handshake)
    sessions = make_session_factory(store_engine)
    with sessions() as session:
        _, key = create_api_key(session, "tests")
    with TestClient(app) as client:
        api = Api(app, client, key, None, handshake, sessions)
        assert client.get("/readyz").json()["checks"]["broker"] == "ok"
        policy = api.register_policy(endpoint="ws://p.test/ws")
        evaluation = api.submit(policy["id"], tasks=["reach-v3", "push-v3"], episodes_per_task=5)
        episodes = client.get(f"/evaluations/{evaluation['id']}/episodes").json()["items"]

    # On the queue of the suite's simulator family (metaworld-mt10 → metaworld), nothing on the bare one.
    assert broker.llen(queue_name) == 0
    queue_name = f"{queue_name}.metaworld"
    assert broker.llen(queue_name) == 10
    # Kombu's Redis transport LPUSHes and consumers BRPOP: the oldest message is at the right end.
    messages = [json.loads(raw) for raw in reversed(broker.lrange(queue_name, 0, -1))]
    sent_ids = []
    for message in messages:
        assert message["headers"]["task"] == "evalforge.run_episode"
        assert message["content-type"] == "application/json"
        assert message["properties"]["delivery_info"]["routing_key"] == queue_name
        args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        assert kwargs == {} and len(args) == 1
        sent_ids.append(args[0])
    assert sent_ids == [e["id"] for e in episodes]

    # The workers' app can read the message with its own (JSON-only) settings.
    worker_app = make_celery_app(QueueSettings(redis_url=redis_url))
    with worker_app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue_name)
        received = simple.get(timeout=5)
        assert received.headers["task"] == "evalforge.run_episode" and received.decode()[0] == [sent_ids[0]]
        received.ack()
        simple.close()
