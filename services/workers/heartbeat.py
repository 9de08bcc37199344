"""A worker's heartbeat in the store: which simulator families it serves, refreshed while it lives.

``evalforge worker`` starts a ``WorkerHeartbeat`` beside Celery: a daemon thread that
upserts the worker's row (``workers``: its node name, host, and ``{family: {package:
version}}`` of the simulators it serves) every ``EVALFORGE_POOL_HEARTBEAT_S`` seconds, and
deletes it when the worker stops cleanly. The API reads the rows to tell an evaluation
that waits for a pool with no live worker (its episodes stay ``pending``, nothing fails)
from one that is merely queued. A worker killed outside its control leaves a row that
stops being refreshed: readers count only rows seen within ``EVALFORGE_WORKER_TIMEOUT_S``.

A failed beat (the database restarting) is logged and retried at the next interval; it
never stops the worker.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from benchmarks.simulators import simulator_versions
from services.store import queries

log = logging.getLogger("evalforge.workers.heartbeat")


class WorkerHeartbeat:
    """Keeps ``worker_id``'s row fresh every ``every_s`` seconds from a daemon thread, until ``stop``."""

    def __init__(self, session_factory: sessionmaker[Session], worker_id: str, simulators: Sequence[str], *,
                 every_s: float) -> None:
        self.session_factory = session_factory
        self.worker_id = worker_id
        self.host = socket.gethostname()
        self.simulators = {family: simulator_versions(family) for family in simulators}
        self.every_s = every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evalforge-heartbeat", daemon=True)

    def beat(self) -> None:
        with self.session_factory() as session:
            queries.record_worker_heartbeat(session, self.worker_id, host=self.host, simulators=self.simulators)

    def start(self) -> WorkerHeartbeat:
        try:
            self.beat()  # before the first episode, so the API sees the pool at once
        except Exception as exc:
            log.warning("worker %s: first heartbeat failed (%s); retrying every %.0f s", self.worker_id, exc,
                        self.every_s)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            try:
                self.beat()
            except Exception as exc:  # the store restarting: try again at the next beat
                log.warning("worker %s: heartbeat failed (%s); retrying in %.0f s", self.worker_id, exc,
                            self.every_s)

    def stop(self) -> None:
        """Stop beating and remove the row (best effort: a row left behind just goes stale)."""
        self._stopped.set()
        self._thread.join(timeout=self.every_s + 5)
        try:
            with self.session_factory() as session:
                queries.remove_worker(session, self.worker_id)
        except Exception as exc:
            log.warning("worker %s: could not remove its row (%s); it goes stale instead", self.worker_id, exc)
