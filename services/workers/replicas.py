"""Policy replicas as one worker process sees them: which server plays the next episode.

A policy may be served by several servers of one checkpoint (``policies.endpoint`` and
its ``policy_endpoints`` rows; every one answered the policy's handshake when it was
added, and every connection checks it again). For each try of an episode the runner asks
``play_on_replicas`` to play it on one of them:

- **Spread**: the replica with the fewest episodes in flight in this process, ties
  broken by the fewest episodes given to it so far (so one-episode-at-a-time workers
  alternate), then by the policy's order. Least-in-flight is the rule load balancers use
  for long requests of uneven cost (an episode is hundreds of round trips); counting per
  worker process needs no coordination, and a thousand processes that each balance
  their own episodes balance the servers too.
- **Fail over**: a try that loses its server (refused, reset, timed out, a transient
  error reply: the runner's ``_PolicyRetryable``) marks that replica *down* and plays
  the episode again from its seed on the next healthy one at once — without a backoff
  and without spending one of the episode's ``policy_retries``, so no episode fails
  ``policy_timeout`` while a healthy replica exists. Only when every replica of the
  policy failed this try does the failure go back to the runner, which backs off and
  retries as it does for a single server.
- **Come back**: a down replica is skipped for ``down_s`` (doubling with each failure in a
  row, up to ``max_down_s``; the runner passes the policy-retry backoff settings,
  ``EVALFORGE_POLICY_BACKOFF_S`` and ``EVALFORGE_POLICY_BACKOFF_MAX_S``), then given the next
  episode as a probe; one that plays an episode to the end is healthy again. No separate health checker: a replica is judged
  by the episodes it serves, in every protocol (openpi and vla-eval servers have no
  ``/readyz``), and a probe that fails costs a connection attempt, then fails over.

The endpoints of an evaluation's policy are read from the store once per
``ENDPOINTS_TTL_S`` per evaluation (a replica added with ``POST /policies/{id}/endpoints``
is used within that time); when the store cannot be read, the policy's first endpoint is
used alone. Endpoints outside ``EVALFORGE_POLICY_HOSTS`` are never connected to.

State is per process and guarded by a lock (episodes may run on several threads).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

from services.policy_hosts import EndpointRefused, check_endpoint
from services.store import queries

log = logging.getLogger("evalforge.workers.replicas")

ENDPOINTS_TTL_S = 10.0
"""How long a worker process uses the endpoints it read for an evaluation before reading them again."""
DOWN_S = 1.0
"""How long a replica that just failed is skipped before it gets a probe (doubles per failure in a row)."""
MAX_DOWN_S = 15.0
"""The longest a failing replica is skipped between two probes."""

T = TypeVar("T")


@dataclass
class ReplicaState:
    """What this process knows of one policy server."""

    in_flight: int = 0
    assigned: int = 0  # tries given to it (the tie-break that alternates sequential episodes)
    failures: int = 0  # failed tries in a row
    down_until: float = 0.0  # time.monotonic() before which it is skipped
    succeeded: int = 0  # tries it played to the end

    def down(self, now: float) -> bool:
        return now < self.down_until


class ReplicaPool:
    """Every policy server this process has used, by endpoint, with their load and health."""

    def __init__(self, *, down_s: float = DOWN_S, max_down_s: float = MAX_DOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.down_s, self.max_down_s, self.clock = down_s, max_down_s, clock
        self.states: dict[str, ReplicaState] = {}
        self._lock = threading.Lock()

    def _state(self, endpoint: str) -> ReplicaState:
        return self.states.setdefault(endpoint, ReplicaState())

    def acquire(self, endpoints: Sequence[str], exclude: Sequence[str] = ()) -> str | None:
        """The endpoint the next try goes to, counted in flight until ``release``: the least busy healthy
        one not in ``exclude``; if every one is down, the one whose probe is due first; None when all
        are excluded."""
        with self._lock:
            now = self.clock()
            candidates = [e for e in endpoints if e not in exclude]
            if not candidates:
                return None
            healthy = [e for e in candidates if not self._state(e).down(now)]
            if healthy:
                order = {e: i for i, e in enumerate(endpoints)}
                chosen = min(healthy, key=lambda e: (self.states[e].in_flight, self.states[e].assigned, order[e]))
            else:
                chosen = min(candidates, key=lambda e: self.states[e].down_until)
            state = self.states[chosen]
            state.in_flight += 1
            state.assigned += 1
            return chosen

    def release(self, endpoint: str, outcome: str, *, down_s: float | None = None,
                max_down_s: float | None = None) -> None:
        """The try on ``endpoint`` ended: ``served`` (played to the end: healthy), ``lost`` (the server was
        lost: down for a while) or ``other`` (the episode's own failure, which says nothing of the server)."""
        with self._lock:
            state = self._state(endpoint)
            state.in_flight = max(0, state.in_flight - 1)
            if outcome == "lost":
                state.failures += 1
                first = self.down_s if down_s is None else down_s
                longest = self.max_down_s if max_down_s is None else max_down_s
                state.down_until = self.clock() + min(longest, first * 2 ** (state.failures - 1))
            elif outcome == "served":
                if state.failures:
                    log.info("policy server %s is healthy again", endpoint)
                state.failures, state.down_until = 0, 0.0
                state.succeeded += 1

    def healthy(self, endpoints: Sequence[str], exclude: Sequence[str] = ()) -> list[str]:
        with self._lock:
            now = self.clock()
            return [e for e in endpoints if e not in exclude and not self._state(e).down(now)]

    def clear(self) -> None:
        with self._lock:
            self.states.clear()


pool = ReplicaPool()
"""This process's replicas (reset in a forked child)."""
_endpoints: dict[tuple[int, str], tuple[float, list[str]]] = {}  # (evaluation, first endpoint) → (read at, endpoints)
_pid = os.getpid()
_lock = threading.Lock()


def _check_fork() -> None:
    global _pid
    if os.getpid() != _pid:
        pool.clear()
        _endpoints.clear()
        _pid = os.getpid()


def policy_endpoints(session_factory: sessionmaker[Session], evaluation_id: int, first: str) -> list[str]:
    """The endpoints of evaluation ``evaluation_id``'s policy (``first`` first), read at most once per
    ``ENDPOINTS_TTL_S``, without those ``EVALFORGE_POLICY_HOSTS`` refuses; ``[first]`` when the store
    cannot be read right now."""
    _check_fork()
    now = time.monotonic()
    with _lock:
        cached = _endpoints.get((evaluation_id, first))
    if cached is not None and now - cached[0] < ENDPOINTS_TTL_S:
        return cached[1]
    try:
        with session_factory() as session:
            endpoints = queries.policy_endpoints_of_evaluation(session, evaluation_id) or [first]
    except Exception as exc:  # the store restarting: play on the first endpoint, read again next time
        log.warning("evaluation %d: could not read its policy's endpoints (%s); using %s", evaluation_id, exc,
                    first)
        return [first]
    allowed = []
    for endpoint in endpoints:
        try:
            check_endpoint(endpoint)
            allowed.append(endpoint)
        except EndpointRefused as exc:
            if endpoint == first:
                allowed.append(endpoint)  # the runner refuses the episode itself, with the reason
            else:
                log.warning("not using replica %s: %s", endpoint, exc)
    with _lock:
        _endpoints[(evaluation_id, first)] = (now, allowed)
        for stale in [k for k, (at, _) in _endpoints.items() if now - at > 10 * ENDPOINTS_TTL_S]:
            del _endpoints[stale]
    return allowed


def play_on_replicas(endpoints: Sequence[str], play: Callable[[str], T], retryable: type[Exception], *,
                     down_s: float = DOWN_S, max_down_s: float = MAX_DOWN_S) -> T:
    """``play(endpoint)`` on the least busy healthy replica, failing over to the others when a try raises
    ``retryable`` (the server was lost: it is skipped for ``down_s``, doubling per failure in a row up to
    ``max_down_s``); the last such error when every replica failed this try.

    Any other exception is the episode's, not the server's: it is raised at once (the replica
    stays healthy). The exception raised carries the endpoint it came from as ``.endpoint``.
    """
    _check_fork()
    if not endpoints:
        raise ValueError("a policy has at least one endpoint")
    tried: list[str] = []
    while True:
        endpoint = pool.acquire(endpoints, exclude=tried)
        assert endpoint is not None  # a healthy one not yet tried was left (checked below)
        tried.append(endpoint)
        try:
            result = play(endpoint)
        except retryable as exc:
            pool.release(endpoint, "lost", down_s=down_s, max_down_s=max_down_s)
            exc.endpoint = endpoint  # type: ignore[attr-defined]
            others = pool.healthy(endpoints, exclude=tried)
            if not others:
                raise
            log.warning("%s; failing over to %s", exc, others[0])
            continue
        except BaseException as exc:
            pool.release(endpoint, "other")
            exc.endpoint = endpoint  # type: ignore[attr-defined]
            raise
        pool.release(endpoint, "served")
        return result
