"""The comparison statistics against scipy.stats and the papers' worked examples.

Published figures, 4 decimals as printed:

- Newcombe 1998, Stat Med 17:873–890 (independent proportions), Table II, method 10,
  examples (a)–(h).
- Newcombe 1998, Stat Med 17:2635–2650 (paired), Table II, method 10, example (a):
  a = 36, b = 12, c = 2, d = 0 (his orientation: p₁ = (a + b)/n) → [0.0569, 0.3404].
- Fagerland, Lydersen and Laake (2014), "Recommended tests and confidence intervals for
  paired binomial proportions", Stat Med 33:2850–2875, the Cavo et al. (2012) table
  59, 6, 16, 80 → Newcombe square-and-add [−0.1186, −0.0046] (also the expected output
  of the R package contingencytables, their book's companion, with 1, 0, 0, 1 →
  [−0.5734, 0.5734]).
"""

from __future__ import annotations

import itertools
import math

import pytest
from scipy import stats

from services.store.statistics import (
    Z_95,
    mcnemar_exact,
    newcombe_paired_interval,
    newcombe_unpaired_interval,
)


def rounded(interval: tuple[float, float] | None) -> tuple[float, float]:
    assert interval is not None
    return round(interval[0], 4), round(interval[1], 4)


# ---------------------------------------------------------------------------- McNemar


@pytest.mark.parametrize(("b", "c"), [(0, 1), (1, 0), (3, 3), (2, 9), (9, 2), (0, 12), (15, 4), (40, 61),
                                      (1, 1), (5, 0), (250, 300)])
def test_mcnemar_exact_is_the_exact_binomial_test_on_the_discordant_pairs(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(c, b + c, 0.5).pvalue, rel=1e-12)


def test_mcnemar_exact_over_every_small_table():
    for b, c in itertools.product(range(13), repeat=2):
        if b + c:
            assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)


def test_mcnemar_without_discordant_pairs_is_no_evidence():
    assert mcnemar_exact(0, 0) == 1.0


def test_mcnemar_with_many_pairs_does_not_underflow():
    p = mcnemar_exact(4_000, 4_400)
    assert 0 < p < 0.01
    assert p == pytest.approx(stats.binomtest(4_000, 8_400, 0.5).pvalue, rel=1e-9)


def test_mcnemar_refuses_negative_counts():
    with pytest.raises(ValueError, match="b=-1"):
        mcnemar_exact(-1, 3)


# ---------------------------------------------------------------------------- unpaired


@pytest.mark.parametrize(("x1", "n1", "x2", "n2", "published"), [
    (56, 70, 48, 80, (0.0524, 0.3339)),  # (a)
    (9, 10, 3, 10, (0.1705, 0.8090)),  # (b)
    (6, 7, 2, 7, (0.0582, 0.8062)),  # (c)
    (5, 56, 0, 29, (-0.0381, 0.1926)),  # (d)
    (0, 10, 0, 20, (-0.1611, 0.2775)),  # (e)
    (0, 10, 0, 10, (-0.2775, 0.2775)),  # (f)
    (10, 10, 0, 20, (0.6791, 1.0000)),  # (g)
    (10, 10, 0, 10, (0.6075, 1.0000)),  # (h)
])
def test_newcombe_unpaired_matches_newcombes_table_ii(x1, n1, x2, n2, published):
    assert rounded(newcombe_unpaired_interval(x1, n1, x2, n2)) == published


def test_newcombe_unpaired_is_antisymmetric_and_none_for_an_empty_sample():
    low, high = newcombe_unpaired_interval(56, 70, 48, 80)
    assert newcombe_unpaired_interval(48, 80, 56, 70) == pytest.approx((-high, -low))
    assert newcombe_unpaired_interval(0, 0, 3, 10) is None
    assert newcombe_unpaired_interval(3, 10, 0, 0) is None


# ---------------------------------------------------------------------------- paired


def test_newcombe_paired_matches_newcombes_table_ii_example_a():
    # Newcombe's table has p1 = (a + b)/n; ours is candidate − baseline = (c − b)/n, so his b is our c.
    assert rounded(newcombe_paired_interval(36, 2, 12, 0)) == (0.0569, 0.3404)


def test_newcombe_paired_matches_fagerland_lydersen_laake():
    # Cavo et al.: before (rows) 59, 6 / 16, 80 after; their difference is row − column = (6 − 16)/161.
    assert rounded(newcombe_paired_interval(59, 16, 6, 80)) == (-0.1186, -0.0046)
    assert rounded(newcombe_paired_interval(1, 0, 0, 1)) == (-0.5734, 0.5734)


def test_the_paired_difference_is_candidate_minus_baseline():
    # 30 pairs: 12 only the candidate succeeded, 2 only the baseline: a clear positive difference.
    low, high = newcombe_paired_interval(10, 2, 12, 6)
    assert 0 < low < (12 - 2) / 30 < high
    assert newcombe_paired_interval(10, 12, 2, 6) == pytest.approx((-high, -low))


def test_paired_interval_contains_the_estimate_and_stays_in_bounds_over_every_small_table():
    for a, b, c, d in itertools.product(range(5), repeat=4):
        if a + b + c + d == 0:
            continue
        low, high = newcombe_paired_interval(a, b, c, d)
        delta = (c - b) / (a + b + c + d)
        assert -1 <= low <= delta <= high <= 1, (a, b, c, d)


def test_paired_edge_cases():
    assert newcombe_paired_interval(0, 0, 0, 0) is None
    # No discordant pairs: the difference is 0 but the interval is not degenerate.
    low, high = newcombe_paired_interval(20, 0, 0, 30)
    assert low < 0 < high and low == pytest.approx(-high)
    # Everything succeeded on both sides (n = 50): centred on 0, as wide as the Wilson interval allows.
    low, high = newcombe_paired_interval(50, 0, 0, 0)
    assert (low, high) == pytest.approx((-0.0713, 0.0713), abs=1e-4)
    # Everything failed on both sides is the mirror image.
    assert newcombe_paired_interval(0, 0, 0, 50) == pytest.approx((low, high))
    # All discordant in the candidate's favour: the upper bound is 1.
    assert newcombe_paired_interval(0, 0, 10, 0)[1] == 1.0


def test_pairing_narrows_the_interval_when_outcomes_agree():
    # The same marginal rates (candidate 60%, baseline 40% of 50), paired with few discordant pairs or
    # unpaired: pairing that removes the seeds' shared difficulty gives a narrower interval.
    paired = newcombe_paired_interval(20, 0, 10, 20)
    unpaired = newcombe_unpaired_interval(30, 50, 20, 50)
    assert paired[1] - paired[0] < unpaired[1] - unpaired[0]


def test_z_is_the_two_sided_95_percent_quantile():
    assert Z_95 == pytest.approx(stats.norm.ppf(0.975), abs=1e-12)
    assert math.isclose(Z_95, 1.959963984540054)
