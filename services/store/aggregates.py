"""Evaluation results from episode rows: success rates with Wilson intervals, steps, latencies.

Pure functions (no database), used live for a running evaluation and once, at
finalisation, to store the final figures.

What counts toward a success rate ("scored" episodes): every succeeded episode and
every failed one — out of steps, or the policy timing out / erroring (the policy,
or its server, failed to act). Left out: cancelled episodes and harness failures
(``HARNESS_FAILURES`` in ``statuses``: the simulator failed, the worker was lost, the
endpoint serves another checkpoint, is not allowed, or was never reached), which say nothing about the policy; they are
reported under ``failure_reasons`` so they are never hidden.

Ranking: an evaluation most of whose episodes are harness failures says little about
the policy (a simulator that kept crashing, a server swapped behind its endpoint) and
is not ranked however its few scored episodes went: ``unranked_reason`` says so in its
detail, and the store's leaderboard rule (``queries.leaderboard_eligibility``) is the
same test on the stored counts — ranked only while harness failures are at most half
of the episodes that ran (``episodes_scored * 2 >= episodes_total``).

Latency: each episode records its policy-call mean and p95. An evaluation reports
the median of the episode means (``p50``, the typical call) and the 95th
percentile of the episode p95s (``p95``, an upper estimate of the per-call p95).
Percentiles interpolate linearly between order statistics (NumPy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.store.models import HARNESS_FAILURES, EpisodeStatus

Z_95 = 1.959963984540054  # two-sided 95% normal quantile
_HARNESS = {reason.value for reason in HARNESS_FAILURES}


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float] | None:
    """Wilson score interval for ``successes`` out of ``trials`` (None when there are no trials).

    Unlike the normal approximation it stays inside [0, 1] and is not degenerate at
    0% or 100%, which matters for the small per-task counts evaluations have.
    """
    if trials < 0 or successes < 0 or successes > trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return None
    p = successes / trials
    z2 = z * z
    denom = 1 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denom
    # At 0/n and n/n the bound is exactly 0 or 1; rounding would leave 1e-17 residue.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """The columns of an episode that aggregates read."""

    task: str
    status: str
    success: bool | None = None
    steps: int | None = None
    latency_mean_ms: float | None = None
    latency_p95_ms: float | None = None
    failure_reason: str | None = None


def status_counts(episodes: Iterable[EpisodeResult]) -> dict[str, int]:
    """Episodes per status, every status present (zero when none)."""
    counts = Counter(e.status for e in episodes)
    return {status.value: counts.get(status.value, 0) for status in EpisodeStatus}


def is_scored(status: str, failure_reason: str | None) -> bool:
    """Whether an episode counts toward a success rate (see the module docstring): it succeeded or
    failed, and not for a harness failure. The comparisons pair on this same rule."""
    return status in (EpisodeStatus.SUCCEEDED, EpisodeStatus.FAILED) and failure_reason not in _HARNESS


def summarize_group(episodes: Sequence[EpisodeResult]) -> dict[str, Any]:
    """Success rate (Wilson 95%), mean steps, latency p50/p95 and failure reasons of some episodes."""
    scored = [e for e in episodes if is_scored(e.status, e.failure_reason)]
    succeeded = sum(1 for e in scored if e.status == EpisodeStatus.SUCCEEDED)
    interval = wilson_interval(succeeded, len(scored))
    steps = [e.steps for e in scored if e.steps is not None]
    means = [e.latency_mean_ms for e in episodes if e.latency_mean_ms is not None]
    p95s = [e.latency_p95_ms for e in episodes if e.latency_p95_ms is not None]
    reasons = Counter(e.failure_reason for e in episodes if e.failure_reason is not None)
    return {
        "episodes": len(episodes),
        "scored": len(scored),
        "succeeded": succeeded,
        "success_rate": succeeded / len(scored) if scored else None,
        "ci95": {"low": interval[0], "high": interval[1]} if interval else None,
        "mean_steps": sum(steps) / len(steps) if steps else None,
        "latency_ms": {"p50": percentile(means, 50), "p95": percentile(p95s, 95)} if means or p95s else None,
        "failure_reasons": dict(sorted(reasons.items())),
    }


def unranked_reason(overall: dict[str, Any]) -> str | None:
    """Why an evaluation with these overall results is not ranked for harness failures (None: it may be).

    Not ranked when most of its episodes that ran are harness failures (see the module docstring)."""
    harness = {reason: n for reason, n in overall["failure_reasons"].items() if reason in _HARNESS}
    failures = sum(harness.values())
    ran = overall["scored"] + failures
    if not ran or failures <= overall["scored"]:
        return None
    shown = ", ".join(f"{reason}: {n}" for reason, n in sorted(harness.items()))
    return (f"not ranked: {failures} of {ran} episodes are harness failures ({shown}), which say nothing about "
            "the policy; fix what failed (the error messages of those episodes say what) and evaluate again")


def summarize(episodes: Sequence[EpisodeResult], task_order: Sequence[str] = ()) -> dict[str, Any]:
    """Counts by status, per-task results (in ``task_order``, then any others) and overall results."""
    by_task: dict[str, list[EpisodeResult]] = {task: [] for task in task_order}
    for episode in episodes:
        by_task.setdefault(episode.task, []).append(episode)
    return {
        "counts": status_counts(episodes),
        "overall": summarize_group(episodes),
        "per_task": [{"task": task, **summarize_group(group)} for task, group in by_task.items()],
    }
