"""Success rates, Wilson intervals and latency percentiles from episode rows (no database)."""

from __future__ import annotations

import math

import pytest

from services.store.aggregates import EpisodeResult, percentile, summarize, wilson_interval


@pytest.mark.parametrize(("successes", "trials", "low", "high"), [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3 (score).
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
    # Closed forms at the edges: 0/n → [0, z²/(n+z²)], n/n → [n/(n+z²), 1].
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (8, 10, 0.4902, 0.9433),
])
def test_wilson_interval_matches_published_values(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got is not None
    assert got[0] == pytest.approx(low, abs=5e-5)
    assert got[1] == pytest.approx(high, abs=5e-5)


def test_wilson_interval_is_symmetric_and_contains_the_estimate():
    for n in (1, 7, 50, 1000):
        for k in range(0, n + 1, max(1, n // 7)):
            low, high = wilson_interval(k, n)
            mirrored = wilson_interval(n - k, n)
            assert 0 <= low <= k / n <= high <= 1
            assert mirrored[0] == pytest.approx(1 - high) and mirrored[1] == pytest.approx(1 - low)


def test_wilson_interval_edge_cases():
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(3, 2)


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_summarize_scores_policy_failures_but_not_harness_failures():
    episodes = [
        EpisodeResult("reach-v3", "succeeded", True, 40, 10.0, 12.0),
        EpisodeResult("reach-v3", "succeeded", True, 60, 20.0, 30.0),
        EpisodeResult("reach-v3", "failed", False, 500, 30.0, 40.0),  # out of steps
        EpisodeResult("reach-v3", "failed", False, 7, None, None, "policy_timeout"),  # scored: counts against
        EpisodeResult("push-v3", "failed", False, 3, None, None, "env_error"),  # harness: not scored
        EpisodeResult("push-v3", "failed", False, None, None, None, "worker_lost"),
        EpisodeResult("push-v3", "cancelled", False, None, None, None, "cancelled"),
        EpisodeResult("push-v3", "pending"),
        EpisodeResult("push-v3", "running"),
    ]
    result = summarize(episodes, ["reach-v3", "push-v3", "pick-place-v3"])
    assert result["counts"] == {"pending": 1, "running": 1, "succeeded": 2, "failed": 4, "cancelled": 1}
    overall = result["overall"]
    assert (overall["episodes"], overall["scored"], overall["succeeded"]) == (9, 4, 2)
    assert overall["success_rate"] == 0.5
    low, high = wilson_interval(2, 4)
    assert overall["ci95"] == {"low": low, "high": high}
    assert overall["mean_steps"] == pytest.approx((40 + 60 + 500 + 7) / 4)
    assert overall["latency_ms"] == {"p50": 20.0, "p95": pytest.approx(39.0)}
    assert overall["failure_reasons"] == {"cancelled": 1, "env_error": 1, "policy_timeout": 1, "worker_lost": 1}
    per_task = {row["task"]: row for row in result["per_task"]}
    assert list(per_task) == ["reach-v3", "push-v3", "pick-place-v3"]
    assert per_task["reach-v3"]["success_rate"] == 0.5
    assert per_task["push-v3"]["scored"] == 0 and per_task["push-v3"]["success_rate"] is None
    assert per_task["push-v3"]["ci95"] is None and per_task["push-v3"]["latency_ms"] is None
    assert per_task["pick-place-v3"]["episodes"] == 0


def test_summary_is_json_ready():
    import json

    result = summarize([EpisodeResult("a", "succeeded", True, 3, 1.5, 2.5)], ["a"])
    assert json.loads(json.dumps(result)) == result
    assert not any(isinstance(v, float) and math.isnan(v) for v in result["overall"].values())
