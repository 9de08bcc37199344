"""Enqueueing episodes for the workers: one Celery task per episode id, sent by name.

Shared by the API (which enqueues new evaluations) and the workers' sweeper (which
re-enqueues episodes that waited too long), so it lives beside ``services/broker.py``
rather than in either.

The API builds its own minimal *producer* Celery app from its settings instead of
importing the workers' app (``services/workers/celery_app.py``): the API process
then loads nothing of the workers (simulators, policy clients), and the contract
between the two is just the task name, its arguments and the queue —
``evalforge.run_episode``, ``[episode_id]``, queue ``episodes`` — which a test
checks against the workers' app.

Publishing happens after the evaluation's transaction has committed (a worker must
find the rows it is sent). If the broker is down, publishing stops at the first
error: the evaluation stays stored and its episodes ``pending``, and the workers'
sweeper re-enqueues episodes that wait too long, so nothing is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from celery import Celery
from kombu import Connection

from services.broker import transport_options

RUN_EPISODE_TASK = "evalforge.run_episode"

log = logging.getLogger("evalforge.api.queue")


class EpisodeQueue(Protocol):
    """Where the API sends episode ids (the Celery producer, or a fake in tests)."""

    def enqueue(self, episode_ids: Sequence[int]) -> int:
        """Send one task per id; returns how many were sent (stops at the first broker error)."""
        ...

    def ping(self) -> None:
        """Raise if the broker cannot be reached."""
        ...


class CeleryEpisodeQueue:
    """Publishes ``evalforge.run_episode(episode_id)`` tasks to the episode queue."""

    def __init__(self, broker_url: str, queue: str = "episodes", timeout_s: float = 2.0) -> None:
        self.broker_url = broker_url
        self.queue = queue
        self.timeout_s = timeout_s
        self.app = Celery("evalforge-api", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_connection_timeout=timeout_s,
            # A publish is retried briefly (a broker restart), not for minutes: the sweeper
            # is the recovery path for anything longer.
            task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.2,
                                       "interval_max": 0.5},
            broker_transport_options=transport_options(broker_url, socket_timeout_s=timeout_s),
        )

    def enqueue(self, episode_ids: Sequence[int]) -> int:
        sent = 0
        try:
            # One producer (one broker connection) for the whole batch.
            with self.app.producer_or_acquire() as producer:
                for episode_id in episode_ids:
                    self.app.send_task(RUN_EPISODE_TASK, args=[episode_id], queue=self.queue, producer=producer)
                    sent += 1
        except Exception as exc:
            log.warning("enqueued %d of %d episodes, then the broker failed (%r); the rest stay pending "
                        "until the sweeper re-enqueues them", sent, len(episode_ids), exc)
        return sent

    def ping(self) -> None:
        with Connection(self.broker_url, connect_timeout=self.timeout_s,
                        transport_options=transport_options(self.broker_url,
                                                            socket_timeout_s=self.timeout_s)) as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=self.timeout_s)
