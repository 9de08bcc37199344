"""Riding out a database restart in the workers: which errors mean "the store is down", and a retry loop.

A PostgreSQL server that restarts (a failover, an upgrade, ``pg_ctl restart``) closes every
connection and refuses new ones for seconds to minutes. The pool pre-pings connections
(``services.store.db``), so once the server is back the first checkout reconnects; while it is
down every statement raises ``OperationalError`` (psycopg's "connection refused", "server closed
the connection unexpectedly", "terminating connection due to administrator command") or, with
every pooled connection stuck, the pool's ``TimeoutError``.

An episode played during the outage is not thrown away: the worker keeps its result and
``retry_while_store_down`` writes it once the store answers again — backing off from
``first_s`` to ``max_s`` (full jitter), giving up after ``budget_s`` (then the lease expires and
the sweeper re-runs the episode, so nothing is lost, only redone). A claim waits the same way
(the broker message stays unacknowledged meanwhile), and a heartbeat that cannot reach the
store is skipped, not fatal (``services/workers/runner.py``). Errors that are not an
outage (a constraint violation, a bug) are raised at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("evalforge.workers.store_retry")

T = TypeVar("T")


def is_store_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached now (a retry later can succeed)."""
    if isinstance(exc, (OperationalError, PoolTimeout)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def retry_while_store_down(call: Callable[[], T], *, what: str, budget_s: float, first_s: float = 0.5,
                           max_s: float = 10.0, sleep: Callable[[float], None] = time.sleep,
                           between: Callable[[], None] | None = None) -> T:
    """``call()``, retried while it fails with a store outage, for up to ``budget_s`` seconds.

    ``what`` names the write in the log ("episode 12's result"); ``between`` runs before each
    retry (e.g. to keep a lease alive elsewhere). The last outage error is raised once the
    budget is spent."""
    deadline = time.monotonic() + budget_s
    delay = first_s
    tries = 0
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_store_outage(exc):
                raise
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("%s: the store is still unreachable after %.0f s (%d tries); giving up: %s", what,
                          budget_s, tries, _first_line(exc))
                raise
            wait = min(left, random.uniform(0, delay) + first_s / 2)
            log.warning("%s: the store is unreachable (%s); retrying in %.1f s", what, _first_line(exc), wait)
            sleep(wait)
            delay = min(max_s, delay * 2)
            if between is not None:
                between()
            continue
        if tries:
            log.info("%s: written after the store came back (%d failed tries)", what, tries)
        return result


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__
