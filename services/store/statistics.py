"""Tests and intervals for comparing two success rates: paired (same tasks and seeds) and unpaired.

Pure functions on counts (stdlib only), one per method, each named for it and tested
against ``scipy.stats`` or the worked examples of the paper it comes from
(``tests/store/test_statistics.py``). ``docs/statistics.md`` says what they mean.

The paired 2×2 table of two evaluations that ran the same (task, seed) episodes, in
this orientation everywhere (comparisons, API, CLI, pages)::

                          candidate succeeded   candidate failed
    baseline succeeded            a                   b
    baseline failed               c                   d

``b`` and ``c`` are the discordant pairs: ``b`` where only the baseline succeeded,
``c`` where only the candidate did. Differences are always **candidate − baseline**
(``(c − b) / n``), so a positive difference means the candidate did better.

- ``mcnemar_exact(b, c)``: the exact (conditional) McNemar test — under "no
  difference" each discordant pair is equally likely to go either way, so ``c`` is
  Binomial(b + c, 1/2); the two-sided p-value doubles the smaller tail (capped at 1).
- ``newcombe_paired_interval(a, b, c, d)``: Newcombe's method 10 for paired data — the
  Wilson score intervals of both marginal rates combined with a correction for their
  correlation (Newcombe 1998, Stat Med 17:2635–2650).
- ``newcombe_unpaired_interval(x1, n1, x2, n2)``: Newcombe's method 10 for independent
  samples, the "square-and-add" of both Wilson intervals (Newcombe 1998, Stat Med
  17:873–890) — for rates that share no seeds (e.g. leaderboard neighbours).
"""

from __future__ import annotations

import math

from services.store.aggregates import Z_95, wilson_interval

__all__ = ["Z_95", "mcnemar_exact", "newcombe_paired_interval", "newcombe_unpaired_interval"]


def _check_counts(**counts: int) -> None:
    negative = {name: value for name, value in counts.items() if value < 0}
    if negative:
        shown = ", ".join(f"{name}={value}" for name, value in negative.items())
        raise ValueError(f"counts must be non-negative, got {shown}")


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs.

    The conditional exact test (McNemar 1947; exact form as in Fagerland, Lydersen and
    Laake 2013, BMC Med Res Methodol 13:91): given ``b + c`` discordant pairs, ``c`` is
    Binomial(b + c, 1/2) when both policies succeed equally often, and
    ``p = min(1, 2 · P(X ≤ min(b, c)))``. The same as
    ``scipy.stats.binomtest(c, b + c, 0.5).pvalue`` (the binomial is symmetric). No
    discordant pair (``b + c = 0``) is no evidence either way: p = 1.
    """
    _check_counts(b=b, c=c)
    n = b + c
    if n == 0:
        return 1.0
    smaller = min(b, c)
    # Exact integer arithmetic: no underflow for thousands of pairs, no rounding in the tail.
    tail = sum(math.comb(n, k) for k in range(smaller + 1))
    return min(1.0, 2 * tail / 2**n)


def newcombe_paired_interval(a: int, b: int, c: int, d: int, z: float = Z_95) -> tuple[float, float] | None:
    """Interval for the paired difference candidate − baseline = ``(c − b) / n``, Newcombe's method 10.

    Newcombe RG (1998) "Improved confidence intervals for the difference between
    binomial proportions based on paired data", Stat Med 17:2635–2650, method 10: with
    ``(l₁, u₁)`` the Wilson interval of the candidate's rate ``p₁ = (a + c) / n`` and
    ``(l₂, u₂)`` the baseline's ``p₂ = (a + b) / n``, and ``φ`` the correlation of the
    two outcomes, ::

        L = δ − √((p₁ − l₁)² − 2φ(p₁ − l₁)(u₂ − p₂) + (u₂ − p₂)²)
        U = δ + √((p₂ − l₂)² − 2φ(p₂ − l₂)(u₁ − p₁) + (u₁ − p₁)²)

    where ``φ = (ad − bc − n/2) / √((a+b)(c+d)(a+c)(b+d))`` when ``ad − bc > n/2``, 0 when
    ``0 ≤ ad − bc ≤ n/2``, ``(ad − bc) / √(…)`` when negative, and 0 when a margin is
    empty (Newcombe's continuity-corrected φ, as the paper's method 10 uses it). The
    table orientation is the module docstring's (``b``: only the baseline succeeded).
    None when there are no pairs (``n = 0``). Stays within [−1, 1] and is not
    degenerate when there are no discordant pairs, unlike the Wald interval.
    """
    _check_counts(a=a, b=b, c=c, d=d)
    n = a + b + c + d
    if n == 0:
        return None
    candidate, baseline = a + c, a + b
    p1, p2 = candidate / n, baseline / n
    l1, u1 = wilson_interval(candidate, n, z)  # type: ignore[misc]  # n > 0: never None
    l2, u2 = wilson_interval(baseline, n, z)  # type: ignore[misc]
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    if margins == 0 or 0 <= cross <= n / 2:
        phi = 0.0
    elif cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(margins)
    else:
        phi = cross / math.sqrt(margins)
    delta = p1 - p2
    # max(0, …): the radicands are sums of squares less a correlation term, non-negative up to rounding.
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return max(-1.0, delta - below), min(1.0, delta + above)


def newcombe_unpaired_interval(x1: int, n1: int, x2: int, n2: int, z: float = Z_95) -> tuple[float, float] | None:
    """Interval for ``x1/n1 − x2/n2`` from independent samples, Newcombe's method 10 (square-and-add).

    Newcombe RG (1998) "Interval estimation for the difference between independent
    proportions: comparison of eleven methods", Stat Med 17:873–890, method 10: with
    the Wilson intervals ``(l₁, u₁)`` of ``p₁ = x1/n1`` and ``(l₂, u₂)`` of ``p₂ = x2/n2``,
    ``L = δ − √((p₁ − l₁)² + (u₂ − p₂)²)`` and ``U = δ + √((u₁ − p₁)² + (p₂ − l₂)²)``.
    For two evaluations that share no seeds; sample 1 is the candidate where one is.
    None when either sample is empty.
    """
    _check_counts(x1=x1, n1=n1, x2=x2, n2=n2)
    interval1, interval2 = wilson_interval(x1, n1, z), wilson_interval(x2, n2, z)
    if interval1 is None or interval2 is None:
        return None
    (l1, u1), (l2, u2) = interval1, interval2
    p1, p2 = x1 / n1, x2 / n2
    delta = p1 - p2
    return (max(-1.0, delta - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)),
            min(1.0, delta + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)))
