"""Token layout, uniform binning and de-binning, and the one builder of prompts and training sequences."""

from __future__ import annotations

import numpy as np
import pytest

from policy_format import ActionTokenizer, PolicyCard, StateTokenizer, TokenLayout, load_checkpoint
from tests.policy_server.conftest import ACTION_DIM, CHUNK, STATE_DIM


def test_the_packed_layout_is_state_then_action_then_tasks_rounded_up_to_64():
    layout = TokenLayout.packed(256, 128, 3)
    assert layout.ranges == {"state": (0, 256), "action": (256, 384), "task": (384, 387)}
    assert (layout.state_bins, layout.action_bins, layout.num_tasks) == (256, 128, 3)
    assert layout.end == 387 and layout.vocab_size == 448 and layout.overlap() is None
    assert TokenLayout.packed(32, 16, 16).vocab_size == 64  # exactly a multiple stays
    assert TokenLayout((0, 10), (5, 20), (20, 21)).overlap() == ("state", "action")


def test_binning_is_the_documented_formula_at_edges_and_beyond_the_bounds():
    low, high, bins = np.array([-1.0, 0.0]), np.array([1.0, 3.0]), 64
    tok = StateTokenizer(low, high, bins, first_id=7)
    edges = low + np.arange(bins + 1)[:, None] / bins * (high - low)
    values = np.concatenate([edges.astype(np.float32), np.nextafter(edges.astype(np.float32), np.float32(-np.inf)),
                             np.random.default_rng(0).uniform(-3, 5, (2000, 2)).astype(np.float32),
                             np.array([[-np.inf, np.inf], [np.inf, -np.inf]], dtype=np.float32)])
    formula = np.clip(np.floor((values.astype(np.float64) - low) * (bins / (high - low))), 0, bins - 1)
    np.testing.assert_array_equal(tok.to_bins(values), formula.astype(np.int64))
    np.testing.assert_array_equal(tok.encode(values), formula.astype(np.int64) + 7)
    assert tok.token_range == (7, 71)


def test_bin_centres_decode_and_encode_back_to_their_own_bins():
    tok = ActionTokenizer([-2.0, 0.0, 10.0], [2.0, 1.0, 10.5], 16, first_id=100)
    bins = np.repeat(np.arange(16)[:, None], 3, axis=1)
    centres = tok.from_bins(bins)
    assert centres.dtype == np.float32
    expected = (tok.low + (bins + 0.5) / 16 * (tok.high - tok.low)).astype(np.float32)
    np.testing.assert_array_equal(centres, expected)
    np.testing.assert_array_equal(tok.to_bins(centres), bins)
    np.testing.assert_array_equal(tok.decode(bins + 100), centres)
    with pytest.raises(ValueError, match=r"outside the action range \[100, 116\]"):
        tok.decode([[99, 100, 100]])


def test_bad_bounds_and_shapes_are_refused():
    with pytest.raises(ValueError, match="high > low"):
        StateTokenizer([0.0, 1.0], [1.0, 1.0], 8)
    with pytest.raises(ValueError, match="bins must be an integer ≥ 2"):
        StateTokenizer([0.0], [1.0], 1)
    with pytest.raises(ValueError, match=r"state values must have 2 dimensions .* got shape \[3\]"):
        StateTokenizer([0.0, 0.0], [1.0, 1.0], 8).encode([0.1, 0.2, 0.3])


def test_prompt_tokens_bin_each_dimension_between_its_bounds(checkpoint):
    tok = load_checkpoint(checkpoint).tokenizer
    state = np.linspace(-1.5, 1.5, STATE_DIM).astype(np.float32)  # beyond the [-1, 1] bounds at both ends
    tokens = tok.prompt("push-v3", state)
    assert tokens[0] == tok.task_token("push-v3") == tok.layout.task_range[0] + 1
    bins = np.array(tokens[1:]) - tok.layout.state_range[0]
    assert bins.min() == 0 and bins.max() == tok.state.bins - 1
    assert (np.diff(bins) >= 0).all()
    assert tokens[1 + STATE_DIM // 2] - tok.layout.state_range[0] == tok.state.bins // 2  # 0.0 → the middle bin
    with pytest.raises(KeyError, match="'lift-v3' is not one of this policy's tasks"):
        tok.prompt("lift-v3", state)


def test_action_tokens_decode_to_bin_centres(checkpoint):
    tok = load_checkpoint(checkpoint).tokenizer
    start = tok.action.token_range[0]
    tokens = [start] * ACTION_DIM + [start + tok.action.bins - 1] * ACTION_DIM + [start + 128] * 2 * ACTION_DIM
    actions = tok.decode_actions(tokens)
    assert actions.shape == (CHUNK, ACTION_DIM) and actions.dtype == np.float32
    width = 2.0 / tok.action.bins
    np.testing.assert_allclose(actions[0], -1 + width / 2, rtol=1e-6)
    np.testing.assert_allclose(actions[1], 1 - width / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="outside the action range"):
        tok.decode_actions([0] * tok.action_len)
    with pytest.raises(ValueError, match=f"expected {CHUNK * ACTION_DIM} action tokens, got 3"):
        tok.decode_actions([start] * 3)


def _card() -> PolicyCard:
    return PolicyCard(name="t", state_dim=3, action_dim=2, chunk_size=2, tasks=["a", "b"],
                      state_low=[-1.0] * 3, state_high=[1.0] * 3, action_low=[-1.0] * 2, action_high=[1.0] * 2,
                      state_bins=16, action_bins=8)


def test_a_sequence_is_the_prompt_then_the_action_chunk_row_by_row():
    tok = _card().tokenizer()
    state = np.array([-1.0, 0.0, 0.99], dtype=np.float32)
    chunk = np.array([[-1.0, 1.0], [0.0, 0.3]], dtype=np.float32)
    assert tok.prompt("b", state) == tok.sequence("b", state).tolist() == [25, 0, 8, 15]
    assert tok.sequence("b", state, chunk).tolist() == [25, 0, 8, 15, 16, 23, 20, 21]
    assert tok.seq_length == 8 and tok.prompt_len == 4 and tok.action_len == 4
    np.testing.assert_array_equal(tok.decode_actions(tok.sequence("b", state, chunk)[tok.prompt_len:]),
                                  tok.action.from_bins(tok.action.to_bins(chunk)))


def test_a_batch_of_sequences_is_each_row_built_alone():
    tok = _card().tokenizer()
    rng = np.random.default_rng(1)
    states, chunks = rng.uniform(-1.2, 1.2, (5, 3)), rng.uniform(-1.2, 1.2, (5, 2, 2))
    tasks = ["a", "b", "b", "a", "b"]
    batch = tok.sequence(tasks, states, chunks)
    assert batch.shape == (5, 8) and batch.dtype == np.int64
    for row, (task, state, chunk) in enumerate(zip(tasks, states, chunks, strict=True)):
        assert batch[row].tolist() == tok.sequence(task, state, chunk).tolist()
    np.testing.assert_array_equal(tok.sequence(tasks, states), batch[:, :tok.prompt_len])
    with pytest.raises(ValueError, match=r"actions must have shape \[5, 2, 2\]"):
        tok.sequence(tasks, states, chunks[:, :1])
    with pytest.raises(ValueError, match="4 tasks for 5 states"):
        tok.sequence(tasks[:4], states)
