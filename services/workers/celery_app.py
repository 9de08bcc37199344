"""The Celery app the episode workers run (the workers issue adds the tasks to it).

Configured for at-least-once delivery of episode ids, which the store's claim /
finish-once rules make safe:

- ``task_acks_late``: a task is acknowledged after it ran, not when received, so a
  worker killed mid-episode does not lose the message;
- ``task_reject_on_worker_lost``: ...and the message goes back to the queue when
  the worker process dies, instead of being acknowledged as failed;
- ``worker_prefetch_multiplier=1``: a worker holds one episode at a time, so long
  episodes do not sit reserved behind each other on one busy worker;
- ``visibility_timeout`` (Redis): how long an unacknowledged message waits before
  redelivery — longer than any episode (the embedded broker, ``services/queue.py``,
  has none: the sweeper covers it);
- JSON only: the queue carries episode ids (one per message, or a list: a batch), never pickles.

The task itself is in ``services/workers/tasks.py`` (loaded through ``include``).

The broker, the queue and the task name come from ``services/queue.py``, which
the API's producer reads too; the API does not import this module.
"""

from __future__ import annotations

from celery import Celery

from services.queue import RUN_EPISODE_TASK, RUN_EPISODES_TASK, QueueSettings, transport_options
from services.queue import settings as default_settings


def make_celery_app(settings: QueueSettings | None = None) -> Celery:
    """The workers' Celery app for the queue ``settings`` (default: from the environment)."""
    settings = settings or default_settings
    celery = Celery("evalforge", broker=settings.effective_broker_url, set_as_current=False,
                    include=["services.workers.tasks"])
    celery.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport_options(settings.effective_broker_url,
                                                   visibility_timeout_s=settings.visibility_timeout_s),
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,  # results live in the store, not in a Celery backend
        task_default_queue=settings.episode_queue,
        task_routes={RUN_EPISODE_TASK: {"queue": settings.episode_queue},
                     RUN_EPISODES_TASK: {"queue": settings.episode_queue}},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return celery


app = make_celery_app()
"""The module-level app (``celery -A services.workers.celery_app worker``)."""
