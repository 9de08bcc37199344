"""Paired comparison of two evaluations: episodes matched by (task, seed), per task and overall.

Two evaluations that ran the same protocol (``provenance.protocol_differences`` is
empty) played the same initial states: episode ``i`` of a task has the same seed on
both sides. Pairing them removes the seeds' shared difficulty from the comparison, so
a paired test detects a smaller difference with the same episodes than two separate
success rates could (``docs/statistics.md``).

What pairs: an episode that is *scored* on both sides — succeeded or failed, not
cancelled and not a harness failure (``HARNESS_FAILURES``: the simulator or the
worker failed, not the policy), the rule of ``aggregates`` that every success rate
here uses. An episode scored on one side only is listed as unpaired with the reason
(its partner is a harness failure, was cancelled, has not finished, or does not
exist); harness failures, cancellations and unfinished episodes are counted per side.
An unfinished evaluation may be compared: the comparison says ``live`` and covers
the pairs finished so far.

For each task and overall: the pairs ``n``, both success rates over them, the
difference candidate − baseline with Newcombe's paired 95% interval (method 10), the
exact McNemar p-value, and the 2×2 table (``statistics``' orientation: ``b`` only the
baseline succeeded, ``c`` only the candidate). The verdict reads the overall McNemar
test at ``ALPHA``; per-task p-values are for looking, not for verdicts (ten tasks
give ten chances of a p < 0.05 by luck).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.store.aggregates import is_scored
from services.store.models import Episode, EpisodeStatus, Evaluation
from services.store.provenance import protocol_differences
from services.store.queries import NotFound, StoreError, get_evaluation
from services.store.statistics import mcnemar_exact, newcombe_paired_interval
from services.store.statuses import HARNESS_FAILURES

ALPHA = 0.05  # the verdict's significance level (two-sided)
LISTED_MAX = 1000  # unpaired episodes and discordant pairs listed at most (their totals are always given)

Side = Literal["baseline", "candidate"]
_HARNESS = frozenset(reason.value for reason in HARNESS_FAILURES)
_UNFINISHED = frozenset({EpisodeStatus.PENDING.value, EpisodeStatus.RUNNING.value})


class NotComparable(StoreError):
    """The two evaluations ran different protocols: their episodes do not pair."""

    def __init__(self, baseline_id: int, candidate_id: int, differences: list[str]) -> None:
        super().__init__(f"evaluations {baseline_id} and {candidate_id} are not comparable, their protocols differ "
                         f"({'; '.join(differences)}); compare evaluations of the same suite, tasks, seeds, step "
                         "limits, cameras and inference settings (submit the candidate with the baseline's)")
        self.differences = differences


@dataclass(frozen=True, slots=True)
class EpisodeOutcome:
    """The columns of an episode that a comparison reads."""

    id: int
    task: str
    seed: int
    status: str
    success: bool | None
    failure_reason: str | None
    artifact_path: str | None

    @property
    def scored(self) -> bool:
        """Counts toward a success rate: ``aggregates``' rule (succeeded or failed, not a harness failure)."""
        return is_scored(self.status, self.failure_reason)

    @property
    def succeeded(self) -> bool:
        return self.status == EpisodeStatus.SUCCEEDED.value

    def why_not_scored(self) -> str:
        if self.status in _UNFINISHED:
            return f"has not finished yet ({self.status})"
        if self.status == EpisodeStatus.CANCELLED.value:
            return "was cancelled"
        return f"is a harness failure ({self.failure_reason})"


@dataclass(frozen=True, slots=True)
class PairedTable:
    """The paired 2×2 table: ``a`` both succeeded, ``b`` only the baseline, ``c`` only the candidate, ``d`` neither."""

    a: int = 0
    b: int = 0
    c: int = 0
    d: int = 0

    @property
    def pairs(self) -> int:
        return self.a + self.b + self.c + self.d

    def __add__(self, other: PairedTable) -> PairedTable:
        return PairedTable(self.a + other.a, self.b + other.b, self.c + other.c, self.d + other.d)


@dataclass(frozen=True, slots=True)
class PairedResult:
    """The comparison over some pairs (one task's, or all of them): rates, difference, interval, test."""

    task: str | None  # None: overall
    table: PairedTable

    @property
    def pairs(self) -> int:
        return self.table.pairs

    @property
    def baseline_rate(self) -> float | None:
        return (self.table.a + self.table.b) / self.pairs if self.pairs else None

    @property
    def candidate_rate(self) -> float | None:
        return (self.table.a + self.table.c) / self.pairs if self.pairs else None

    @property
    def difference(self) -> float | None:
        """Candidate − baseline success rate over the pairs (None without pairs)."""
        return (self.table.c - self.table.b) / self.pairs if self.pairs else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        """Newcombe's paired 95% interval of the difference (method 10)."""
        t = self.table
        return newcombe_paired_interval(t.a, t.b, t.c, t.d)

    @property
    def p_value(self) -> float | None:
        """Two-sided exact McNemar p-value (None without pairs; 1 with pairs but no discordant ones)."""
        return mcnemar_exact(self.table.b, self.table.c) if self.pairs else None


@dataclass(frozen=True, slots=True)
class SideCounts:
    """What one side's episodes contributed: scored, and what was left out of the pairs and why."""

    evaluation_id: int
    scored: int = 0
    harness_failures: dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    unfinished: int = 0


@dataclass(frozen=True, slots=True)
class UnpairedEpisode:
    """A scored episode whose (task, seed) is not scored on the other side."""

    task: str
    seed: int
    side: Side
    episode_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class DiscordantPair:
    """A (task, seed) on which exactly one side succeeded, with both episodes (and their replays)."""

    task: str
    seed: int
    succeeded: Side
    baseline_episode_id: int
    candidate_episode_id: int
    baseline_artifact_path: str | None
    candidate_artifact_path: str | None


@dataclass(frozen=True, slots=True)
class Comparison:
    baseline: Evaluation
    candidate: Evaluation
    live: bool  # either side not finalised yet: the figures cover the pairs finished so far
    per_task: list[PairedResult]
    overall: PairedResult
    baseline_counts: SideCounts
    candidate_counts: SideCounts
    unpaired: list[UnpairedEpisode]  # the first LISTED_MAX
    unpaired_total: int
    discordant: list[DiscordantPair]  # the first LISTED_MAX, in task order then seed
    verdict: str


def format_p(p: float) -> str:
    """A p-value as people read it: ``0.003``, ``0.41``, ``< 0.001``."""
    if p < 0.001:
        return "< 0.001"
    return f"= {p:.3f}" if p < 0.1 else f"= {p:.2f}"


def verdict(overall: PairedResult, *, live: bool = False) -> str:
    """``candidate better (p = 0.003)``, ``baseline better (p = 0.012)`` or ``no detectable difference at
    n = 50 (p = 0.41)``: the overall exact McNemar test at ``ALPHA``.

    "No detectable difference" is not "equal": at n pairs only differences larger than
    the interval's half-width could have been seen (``docs/statistics.md``)."""
    so_far = " so far" if live else ""
    if overall.pairs == 0:
        return ("no paired episodes yet: no (task, seed) is scored on both sides" + so_far if live else
                "nothing to compare: no (task, seed) is scored on both sides")
    p = overall.p_value
    assert p is not None  # pairs > 0
    if p < ALPHA:
        better = "candidate" if overall.table.c > overall.table.b else "baseline"
        return f"{better} better (p {format_p(p)}, n = {overall.pairs}){so_far}"
    return f"no detectable difference at n = {overall.pairs} (p {format_p(p)}){so_far}"


def episode_outcomes(session: Session, evaluation_id: int) -> list[EpisodeOutcome]:
    """Every episode of an evaluation, the columns a comparison reads, in episode order."""
    rows = session.execute(
        select(Episode.id, Episode.task, Episode.seed, Episode.status, Episode.success, Episode.failure_reason,
               Episode.artifact_path)
        .where(Episode.evaluation_id == evaluation_id).order_by(Episode.episode_index))
    return [EpisodeOutcome(*row) for row in rows]


def _side_counts(evaluation_id: int, episodes: Iterable[EpisodeOutcome]) -> SideCounts:
    episodes = list(episodes)
    harness = Counter(e.failure_reason for e in episodes if e.failure_reason in _HARNESS)
    return SideCounts(evaluation_id=evaluation_id, scored=sum(e.scored for e in episodes),
                      harness_failures=dict(sorted(harness.items())),
                      cancelled=sum(e.status == EpisodeStatus.CANCELLED.value for e in episodes),
                      unfinished=sum(e.status in _UNFINISHED for e in episodes))


def pair_episodes(baseline: Sequence[EpisodeOutcome], candidate: Sequence[EpisodeOutcome],
                  task_order: Sequence[str] = ()) -> tuple[dict[str, PairedTable], list[UnpairedEpisode],
                                                           list[DiscordantPair]]:
    """Pair two evaluations' episodes by (task, seed): per-task tables (in ``task_order``, then any other
    task), the unpaired scored episodes and the discordant pairs."""
    sides: dict[Side, dict[tuple[str, int], EpisodeOutcome]] = {
        "baseline": {(e.task, e.seed): e for e in baseline}, "candidate": {(e.task, e.seed): e for e in candidate}}
    tables: dict[str, PairedTable] = {task: PairedTable() for task in task_order}
    unpaired: list[UnpairedEpisode] = []
    discordant: list[DiscordantPair] = []
    keys = sorted(sides["baseline"].keys() | sides["candidate"].keys(),
                  key=lambda key: (task_order.index(key[0]) if key[0] in task_order else len(task_order), key))
    for key in keys:
        base, cand = sides["baseline"].get(key), sides["candidate"].get(key)
        if base is not None and cand is not None and base.scored and cand.scored:
            both, neither = base.succeeded and cand.succeeded, not (base.succeeded or cand.succeeded)
            cell = PairedTable(a=int(both), b=int(base.succeeded and not cand.succeeded),
                               c=int(cand.succeeded and not base.succeeded), d=int(neither))
            tables[key[0]] = tables.get(key[0], PairedTable()) + cell
            if cell.b or cell.c:
                discordant.append(DiscordantPair(
                    task=key[0], seed=key[1], succeeded="baseline" if cell.b else "candidate",
                    baseline_episode_id=base.id, candidate_episode_id=cand.id,
                    baseline_artifact_path=base.artifact_path, candidate_artifact_path=cand.artifact_path))
            continue
        for side, episode, partner in (("baseline", base, cand), ("candidate", cand, base)):
            if episode is None or not episode.scored:
                continue
            other = "candidate" if side == "baseline" else "baseline"
            reason = (f"no episode of this task and seed on the {other} side" if partner is None
                      else f"the {other}'s episode {partner.why_not_scored()}")
            unpaired.append(UnpairedEpisode(task=key[0], seed=key[1], side=side, episode_id=episode.id,
                                            reason=reason))
        tables.setdefault(key[0], PairedTable())
    return tables, unpaired, discordant


def compare_evaluations(session: Session, baseline_id: int, candidate_id: int) -> Comparison:
    """The paired comparison of two evaluations (see the module docstring).

    ``NotFound`` when either does not exist; ``NotComparable`` (naming what differs) when their
    protocols differ. Either may still be running (``live``)."""
    evaluations = {}
    for side, evaluation_id in (("baseline", baseline_id), ("candidate", candidate_id)):
        evaluation = get_evaluation(session, evaluation_id)
        if evaluation is None:
            raise NotFound(f"no evaluation with id {evaluation_id} (the {side})")
        evaluations[side] = evaluation
    baseline, candidate = evaluations["baseline"], evaluations["candidate"]
    differences = protocol_differences(baseline, candidate)
    if differences:
        raise NotComparable(baseline_id, candidate_id, differences)
    baseline_episodes = episode_outcomes(session, baseline_id)
    candidate_episodes = episode_outcomes(session, candidate_id)
    tables, unpaired, discordant = pair_episodes(baseline_episodes, candidate_episodes, baseline.tasks)
    per_task = [PairedResult(task=task, table=table) for task, table in tables.items()]
    overall = PairedResult(task=None, table=sum((row.table for row in per_task), PairedTable()))
    live = not (baseline.finalised and candidate.finalised)
    return Comparison(
        baseline=baseline, candidate=candidate, live=live, per_task=per_task, overall=overall,
        baseline_counts=_side_counts(baseline_id, baseline_episodes),
        candidate_counts=_side_counts(candidate_id, candidate_episodes),
        unpaired=unpaired[:LISTED_MAX], unpaired_total=len(unpaired), discordant=discordant[:LISTED_MAX],
        verdict=verdict(overall, live=live))
