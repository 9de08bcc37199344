"""The episode queue: the broker, its settings, and the one contract between the API and the workers.

The API (which enqueues new evaluations), the workers' Celery app (which consumes
them) and the sweeper (which re-enqueues stranded episodes) all read this module,
so the broker URL, the queue name and the task name exist once:

- ``QueueSettings`` / ``settings``: ``REDIS_URL``, ``EVALFORGE_BROKER_URL``,
  ``EVALFORGE_EPISODE_QUEUE``, ``EVALFORGE_BROKER_TIMEOUT_S``,
  ``EVALFORGE_VISIBILITY_TIMEOUT_S``, read once from the environment;
- ``RUN_EPISODE_TASK`` (``evalforge.run_episode``, one argument: an episode id) and
  ``RUN_EPISODES_TASK`` (``evalforge.run_episodes``, one argument: a list of episode ids, a
  batch the worker claims, plays and records together): the task names
  (``services/workers/tasks.py`` registers both; workers keep consuming one-id messages);
- ``queue_name(simulator)``: one queue per simulator family, ``<EVALFORGE_EPISODE_QUEUE>.<family>``
  (``episodes.metaworld``, ``episodes.libero``…), so each family has its own pool of workers
  (``evalforge worker --simulators``); the bare ``episodes`` queue carries what was enqueued
  without a family (by an older API) and every worker consumes it too;
- ``transport_options``: the kombu options a broker URL needs;
- ``CeleryEpisodeQueue``: the producer that publishes the episode ids: one per message, or
  ``EVALFORGE_EPISODES_PER_MESSAGE`` per message (K > 1: ``evalforge.run_episodes`` batches).

Episodes per message: with K = 1 (the default) every message is the one-id task, as before.
K > 1 packs up to K ids of one ``enqueue`` call per message: the worker then claims the K with
one statement, writes their results together and pays Celery's per-message work once per K
(docs/benchmarks.md, "Batched messages and results"). A batch is played one episode after
another by one worker thread, so K suits short episodes (the control plane, fast simulators);
for episodes of minutes leave it at 1 (a batch holds K leases and is redelivered whole, and
Redis's ``visibility_timeout`` must exceed K × the longest episode). Deploy workers that know
``evalforge.run_episodes`` before raising K on the API and the sweeper.

Two brokers are supported:

- **Redis** (``redis://host:port/db``, ``REDIS_URL``): the full stack. Unacknowledged
  messages come back after ``visibility_timeout``.
- **Embedded** (``filesystem:///ABSOLUTE/DIR``): what ``evalforge up`` uses when
  ``REDIS_URL`` is not set — kombu's filesystem transport, one file per message under
  ``DIR/queue``, no server to run. A consumer takes a message by renaming its file
  into ``DIR/processed`` (atomic on one filesystem, so two workers never take the same
  one); ``prune_processed`` deletes those files later. It serves the processes of one
  machine; a message taken by a worker that is then SIGKILLed is not redelivered by
  the broker, and the sweeper re-enqueues its episode once the lease expires
  (DESIGN.md), as it does for messages a Redis restart loses.

The producer is a minimal Celery app of its own, not the workers' app
(``services/workers/celery_app.py``): the API process then loads nothing of the
workers (simulators, policy clients). Publishing happens after the evaluation's
transaction has committed (a worker must find the rows it is sent). If the broker
is down, publishing stops at the first error: the evaluation stays stored and its
episodes ``pending``, and the sweeper re-enqueues episodes that wait too long, so
nothing is lost. This module imports nothing else of EvalForge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from celery import Celery
from kombu import Connection
from kombu.utils.uuid import uuid
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

RUN_EPISODE_TASK = "evalforge.run_episode"
"""Task name; its one argument is the episode id."""

RUN_EPISODES_TASK = "evalforge.run_episodes"
"""Task name; its one argument is a list of episode ids (a batch, ``episodes_per_message`` > 1)."""

PUBLISH_CHUNK = 1000
"""Messages published per Redis pipeline round trip."""

EMBEDDED_SCHEME = "filesystem"
EMBEDDED_POLL_S = 0.2
"""How often an idle embedded-broker consumer looks for new message files."""

log = logging.getLogger("evalforge.queue")


class QueueSettings(BaseSettings):
    """``REDIS_URL`` and ``EVALFORGE_*`` variables of the episode queue, read by the API and the workers alike."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_", populate_by_name=True, extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL",
                           description="Redis, the Celery broker episodes are enqueued on and consumed from.")
    broker_url: str | None = Field(
        None, description="Celery broker URL when it is not REDIS_URL (e.g. an embedded transport).")
    episode_queue: str = Field("episodes", description="Queue the episode tasks go to and are consumed from.")
    broker_timeout_s: float = Field(2.0, gt=0, description="Connect/publish timeout of the API and the sweeper "
                                                           "for the broker.")
    episodes_per_message: int = Field(1, ge=1, le=1000, description=(
        "Episode ids per broker message: 1 sends one `evalforge.run_episode` task per episode; K > 1 sends "
        "`evalforge.run_episodes` batches of up to K ids, claimed and recorded together by the worker (for "
        "short episodes; the workers must know that task)."))
    visibility_timeout_s: int = Field(
        3600, ge=60, description=("Redis: an unacknowledged task is redelivered after this long. Must exceed the "
                                  "longest episode, or a slow episode is run twice (harmless, but wasted)."))

    @property
    def effective_broker_url(self) -> str:
        """The broker in use: ``broker_url`` when set, else ``redis_url``."""
        return self.broker_url or self.redis_url


settings = QueueSettings()
"""The process-wide queue settings, read once from the environment at import."""


# ---------------------------------------------------------------------------- broker URLs


class BrokerURLError(ValueError):
    """A broker URL this project cannot use."""


def is_embedded(broker_url: str) -> bool:
    return urlparse(broker_url).scheme == EMBEDDED_SCHEME


def embedded_broker_url(directory: Path | str) -> str:
    """The URL of an embedded broker whose messages live under ``directory``."""
    return f"{EMBEDDED_SCHEME}://{Path(directory).resolve()}"


def embedded_broker_dir(broker_url: str) -> Path:
    path = urlparse(broker_url).path
    if not path or not path.startswith("/"):
        raise BrokerURLError(f"embedded broker URL {broker_url!r} has no absolute directory; "
                             f"write it as {EMBEDDED_SCHEME}:///absolute/path/to/broker")
    return Path(path)


def transport_options(broker_url: str, *, visibility_timeout_s: float | None = None,
                      socket_timeout_s: float | None = None) -> dict[str, Any]:
    """kombu ``transport_options`` for ``broker_url`` (creates an embedded broker's folders)."""
    if is_embedded(broker_url):
        root = embedded_broker_dir(broker_url)
        folders = {name: root / name for name in ("queue", "control", "processed")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        return {"data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
                "control_folder": str(folders["control"]), "processed_folder": str(folders["processed"]),
                # taken messages are renamed into processed/ (atomic), not moved across filesystems
                "store_processed": True, "polling_interval": EMBEDDED_POLL_S}
    options: dict[str, Any] = {}
    if visibility_timeout_s is not None:
        options["visibility_timeout"] = visibility_timeout_s
    if socket_timeout_s is not None:
        options |= {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
    return options


def prune_processed(broker_url: str, older_than_s: float = 600.0) -> int:
    """Delete an embedded broker's taken message files older than ``older_than_s``; returns how many."""
    if not is_embedded(broker_url):
        return 0
    folder = embedded_broker_dir(broker_url) / "processed"
    cutoff = time.time() - older_than_s
    removed = 0
    for path in folder.glob("*.msg") if folder.is_dir() else ():
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


# ---------------------------------------------------------------------------- the producer


def queue_name(simulator: str | None, base: str | None = None) -> str:
    """The queue of a simulator family's episodes (``None``: the bare queue every worker consumes)."""
    base = base or settings.episode_queue
    return base if simulator is None else f"{base}.{simulator}"


class EpisodeQueue(Protocol):
    """Where episode ids are sent (the Celery producer, or a recording queue in tests)."""

    def enqueue(self, episode_ids: Sequence[int], simulator: str | None = None) -> int:
        """Send one task per id to ``simulator``'s queue; returns how many were sent (stops at the
        first broker error)."""
        ...

    def ping(self) -> None:
        """Raise if the broker cannot be reached."""
        ...


class CeleryEpisodeQueue:
    """Publishes ``evalforge.run_episode(episode_id)`` tasks to the episode queue, or with
    ``episodes_per_message`` K > 1 ``evalforge.run_episodes([id, …])`` tasks of up to K ids each."""

    def __init__(self, broker_url: str, queue: str | None = None, timeout_s: float | None = None,
                 episodes_per_message: int | None = None) -> None:
        self.broker_url = broker_url
        self.queue = queue or settings.episode_queue
        self.timeout_s = timeout_s if timeout_s is not None else settings.broker_timeout_s
        self.episodes_per_message = (episodes_per_message if episodes_per_message is not None
                                     else settings.episodes_per_message)
        if self.episodes_per_message < 1:
            raise ValueError(f"episodes_per_message must be at least 1, got {self.episodes_per_message}")
        self.app = Celery("evalforge-producer", broker=broker_url, set_as_current=False)
        self.app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_connection_timeout=self.timeout_s,
            # A publish is retried briefly (a broker restart), not for minutes: the sweeper
            # is the recovery path for anything longer.
            task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.2,
                                       "interval_max": 0.5},
            broker_transport_options=transport_options(broker_url, socket_timeout_s=self.timeout_s),
        )

    @classmethod
    def from_settings(cls, queue_settings: QueueSettings | None = None) -> CeleryEpisodeQueue:
        """The producer for ``queue_settings`` (default: from the environment)."""
        s = queue_settings or settings
        return cls(s.effective_broker_url, s.episode_queue, s.broker_timeout_s, s.episodes_per_message)

    def enqueue(self, episode_ids: Sequence[int], simulator: str | None = None) -> int:
        """Publish in chunks of ``PUBLISH_CHUNK`` messages: on Redis each chunk is one pipeline (kombu's
        ``Producer.batch``), and each message is built by Celery's own ``create_task_message`` and
        published straight to the queue (``send_task``'s routing and signals cost 4× more per
        message: 100,000 episodes took 63 s to reach Redis, now ~10 s). Each message carries one id,
        or up to ``episodes_per_message`` ids in order. Returns the episodes sent: a chunk counts once
        it was flushed; after a failure the rest stay pending for the sweeper (a message of the
        failed chunk that did land is a harmless duplicate)."""
        sent = 0
        queue = queue_name(simulator, self.queue)
        amqp = self.app.amqp
        k = self.episodes_per_message
        ids = [int(i) for i in episode_ids]
        messages = ([(RUN_EPISODE_TASK, (i,)) for i in ids] if k == 1 else
                    [(RUN_EPISODES_TASK, (ids[start:start + k],)) for start in range(0, len(ids), k)])
        try:
            # One producer (one broker connection) for the whole batch.
            with self.app.producer_or_acquire() as producer:
                for start in range(0, len(messages), PUBLISH_CHUNK):
                    chunk = messages[start:start + PUBLISH_CHUNK]
                    with producer.batch(max_size=len(chunk) + 1):
                        for task, args in chunk:
                            message = amqp.create_task_message(uuid(), task, args, {}, ignore_result=True)
                            producer.publish(message.body, exchange="", routing_key=queue, serializer="json",
                                             headers=message.headers, retry=True,
                                             retry_policy=self.app.conf.task_publish_retry_policy,
                                             **message.properties)
                    sent += sum(1 if task == RUN_EPISODE_TASK else len(args[0]) for task, args in chunk)
        except Exception as exc:
            log.warning("enqueued %d of %d episodes, then the broker failed (%r); the rest stay pending "
                        "until the sweeper re-enqueues them", sent, len(episode_ids), exc)
        return sent

    def ping(self) -> None:
        with Connection(self.broker_url, connect_timeout=self.timeout_s,
                        transport_options=transport_options(self.broker_url,
                                                            socket_timeout_s=self.timeout_s)) as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=self.timeout_s)
