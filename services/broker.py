"""The Celery broker: which one a URL names, and the kombu transport options it needs.

Shared by the API's producer (``services/episode_queue.py``) and the workers' app
(``services/workers/celery_app.py``) so that both sides read a broker URL the same
way. A leaf module: it imports nothing of ours.

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
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

EMBEDDED_SCHEME = "filesystem"
EMBEDDED_POLL_S = 0.2
"""How often an idle embedded-broker consumer looks for new message files."""


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
