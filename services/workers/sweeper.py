"""The sweeper: nothing stranded by a lost broker message or a dead worker.

Each sweep (``sweep_once``):

- closes ``running`` episodes of cancelled evaluations whose lease expired
  (``cancelled``; a live one is left to finish, as cancelling promises);
- marks ``running`` episodes whose lease expired with no attempts left ``worker_lost``;
- re-enqueues ``running`` episodes whose lease expired (attempts left) and
  ``pending`` episodes older than ``pending_after_s`` — each at most once per
  ``pending_after_s``, so a long queue is not flooded with duplicates (a duplicate
  is harmless anyway: the claim is a conditional update), on the queue of their suite's
  simulator family;
- finalises evaluations whose episodes are all terminal but that nobody finalised
  (a worker died in between);
- finishes writing the episode rows of a large evaluation whose API process died after
  its 202, part-way through (``queries.materialize_all``: the rest of the chunks, each
  enqueued after its commit), once it is older than ``pending_after_s`` — the API's own
  materialiser, if it is merely slow, is not disturbed before then, and sharing the work
  with it would be safe anyway (each chunk is written by one of them).

``evalforge sweeper`` runs ``run_forever`` (one sweeper process is enough; two are
safe, only wasteful). While the database is unreachable it waits: each failed sweep is one
warning line, and the next sweep after the store is back does the work (leases that expired
during the outage are re-enqueued then; a worker that kept playing finishes them first or
finds them superseded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from benchmarks.registry import SuiteError, get_suite
from services.queue import CeleryEpisodeQueue, EpisodeQueue
from services.store import queries
from services.store.models import utcnow
from services.workers.settings import WorkerSettings
from services.workers.store_retry import is_store_outage

log = logging.getLogger("evalforge.workers.sweeper")


@dataclass
class SweepReport:
    """What one sweep did."""

    reenqueued: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # evaluation ids with episodes marked worker_lost
    cancelled: list[int] = field(default_factory=list)  # evaluation ids with running episodes closed
    finalised: list[int] = field(default_factory=list)
    materialized: list[int] = field(default_factory=list)  # evaluation ids whose missing episode rows it wrote


class Sweeper:
    """Holds when each episode was last re-enqueued, so repeated sweeps do not flood the queue."""

    def __init__(self, session_factory: sessionmaker[Session], queue: EpisodeQueue, settings: WorkerSettings,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_factory = session_factory
        self.queue = queue
        self.settings = settings
        self.clock = clock
        self._sent_at: dict[int, float] = {}

    def sweep_once(self) -> SweepReport:
        s, report = self.settings, SweepReport()
        now = utcnow()
        self._materialize(now - timedelta(seconds=s.pending_after_s), report)
        with self.session_factory() as session:
            report.cancelled = queries.close_cancelled_running_episodes(session, now=now)
            report.lost = queries.mark_lost_episodes(session, max_attempts=s.max_attempts, now=now)
            expired = queries.expired_episode_ids(session, max_attempts=s.max_attempts, now=now)
            stale = queries.stale_pending_episode_ids(
                session, created_before=now - timedelta(seconds=s.pending_after_s))
            for evaluation_id in {*report.cancelled, *report.lost, *queries.unfinalised_evaluation_ids(session)}:
                if queries.finalize_evaluation_if_done(session, evaluation_id):
                    report.finalised.append(evaluation_id)
        tick = self.clock()
        due = [i for i in dict.fromkeys([*expired, *stale])
               if tick - self._sent_at.get(i, float("-inf")) >= s.pending_after_s]
        if due:
            with self.session_factory() as session:
                suites = queries.episode_suites(session, due)
            for simulator, episode_ids in _by_simulator(due, suites).items():
                sent = self.queue.enqueue(episode_ids, simulator)
                for episode_id in episode_ids[:sent]:
                    self._sent_at[episode_id] = tick
                report.reenqueued.extend(episode_ids[:sent])
        live = set(expired) | set(stale)
        self._sent_at = {i: t for i, t in self._sent_at.items() if i in live}
        if report.reenqueued or report.lost or report.cancelled or report.finalised or report.materialized:
            log.info("sweep: re-enqueued %d episodes, worker_lost in evaluations %s, cancelled running in %s, "
                     "finalised %s, episode rows written for %s", len(report.reenqueued), report.lost,
                     report.cancelled, report.finalised, report.materialized)
        return report

    def _materialize(self, created_before: datetime, report: SweepReport) -> None:
        """Write the missing episode rows of evaluations an API process left part-way (killed after the
        202), each chunk enqueued on its suite's simulator queue after its commit."""
        with self.session_factory() as session:
            for evaluation_id, suite in queries.unmaterialized_evaluations(session, created_before=created_before):
                simulator = _simulator(suite)
                try:
                    published = queries.materialize_all(
                        session, evaluation_id, lambda ids, simulator=simulator: self.queue.enqueue(ids, simulator))
                except ValueError as exc:  # a row with no plan to write from: say so, and sweep the rest
                    log.error("sweep: cannot write the episode rows of evaluation %d: %s", evaluation_id, exc)
                    continue
                report.materialized.append(evaluation_id)
                log.info("sweep: wrote the missing episode rows of evaluation %d (%d enqueued)", evaluation_id,
                         published)

    def run_forever(self, *, stop: Callable[[], bool] = lambda: False) -> None:
        """Sweep every ``sweep_every_s`` seconds until ``stop()``; a failing sweep is logged and retried."""
        while not stop():
            try:
                self.sweep_once()
            except Exception as exc:
                if is_store_outage(exc):  # a restarting database: wait for it, no traceback per sweep
                    log.warning("sweep skipped, the store is unreachable (%s); trying again in %.0f s",
                                str(exc).splitlines()[0][:200], self.settings.sweep_every_s)
                else:
                    log.exception("sweep failed; trying again in %.0f s", self.settings.sweep_every_s)
            time.sleep(self.settings.sweep_every_s)


def _by_simulator(episode_ids: list[int], suites: dict[int, str]) -> dict[str | None, list[int]]:
    """Episode ids grouped by the simulator family of their suite (the queue they go back to); a
    suite this version does not know goes to the bare queue, which every worker consumes."""
    groups: dict[str | None, list[int]] = {}
    for episode_id in episode_ids:
        groups.setdefault(_simulator(suites.get(episode_id)), []).append(episode_id)
    return groups


def _simulator(suite: str | None) -> str | None:
    """The simulator family whose queue runs ``suite``'s episodes; None (the bare queue) for a suite
    this version does not know."""
    if suite is None:
        return None
    try:
        return get_suite(suite).simulator
    except SuiteError:
        return None


def make_sweeper(settings: WorkerSettings) -> Sweeper:
    """A sweeper on ``DATABASE_URL`` that publishes to the broker and queue of ``services.queue.settings``."""
    from services.store.db import create_db_engine, make_session_factory

    return Sweeper(make_session_factory(create_db_engine()), CeleryEpisodeQueue.from_settings(), settings)
