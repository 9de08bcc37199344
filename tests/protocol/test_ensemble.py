"""Inference settings on the client's side: execution horizons and ACT's temporal ensembling, against a
policy whose chunks are known, so every executed action can be computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from services.protocol.client import ActionChunkBroker
from services.protocol.ensemble import TemporalEnsembleBroker, make_broker
from services.protocol.messages import ActionsReply


class CountingPolicy:
    """A policy client whose chunk asked for at step t is rows t*10 + 0, 1, 2, … (one action dim)."""

    def __init__(self, chunk: int = 3) -> None:
        self.chunk = chunk
        self.steps: list[int] = []

    def infer(self, obs, *, episode_id=None, step=0) -> ActionsReply:
        self.steps.append(step)
        rows = np.arange(self.chunk, dtype=np.float32)[:, None] + 10 * obs["t"]
        return ActionsReply(request_id=len(self.steps), actions=rows)


def _play(broker, steps: int) -> list[float]:
    return [float(broker.act({"t": t})[0]) for t in range(steps)]


def test_the_default_executes_whole_chunks_and_a_horizon_the_first_k():
    policy = CountingPolicy(chunk=3)
    assert _play(make_broker(policy, None), 6) == [0, 1, 2, 30, 31, 32]
    assert policy.steps == [0, 3]
    policy = CountingPolicy(chunk=3)
    assert _play(make_broker(policy, {"action_horizon": 2}), 6) == [0, 1, 20, 21, 40, 41]
    assert policy.steps == [0, 2, 4]
    assert isinstance(make_broker(policy, {}), ActionChunkBroker)


def test_temporal_ensembling_averages_every_prediction_for_the_step_oldest_weighted_most():
    m = 0.5
    policy = CountingPolicy(chunk=3)
    broker = make_broker(policy, {"temporal_ensemble": m})
    assert isinstance(broker, TemporalEnsembleBroker) and broker.needs_observation
    got = _play(broker, 5)
    assert policy.steps == [0, 1, 2, 3, 4], "a new chunk every step"
    # Step t is predicted by the chunks of steps t-2, t-1, t (those still covering it): the chunk of
    # step s predicts 10 s + (t - s) for step t. Weights exp(-m i), i = 0 for the oldest.
    for t, value in enumerate(got):
        starts = [s for s in range(max(0, t - 2), t + 1)]
        predictions = np.array([10 * s + (t - s) for s in starts], dtype=np.float64)
        weights = np.exp(-m * np.arange(len(starts)))
        assert value == pytest.approx((weights * predictions).sum() / weights.sum(), rel=1e-6), t
    broker.reset("next")
    assert _play(broker, 1) == [0.0], "reset forgets the previous episode's chunks"


def test_temporal_ensembling_with_a_chunk_of_one_is_the_policy_itself():
    policy = CountingPolicy(chunk=1)
    assert _play(make_broker(policy, {"temporal_ensemble": 0.1}), 4) == [0, 10, 20, 30]
    assert _play(make_broker(CountingPolicy(chunk=1), {"action_horizon": 1}), 4) == [0, 10, 20, 30]
    assert _play(make_broker(CountingPolicy(chunk=1), None), 4) == [0, 10, 20, 30]


@pytest.mark.parametrize("settings, fragment", [
    ({"action_horizon": 2, "temporal_ensemble": 0.1}, "exclude each other"),
    ({"horizon": 2}, "unknown inference setting"),
])
def test_bad_settings_are_refused(settings, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_broker(CountingPolicy(), settings)
    with pytest.raises(ValueError, match="finite number"):
        TemporalEnsembleBroker(CountingPolicy(), weight=float("nan"))
