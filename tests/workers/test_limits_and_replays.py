"""Per-episode time limits and replay GIFs, through the runner function with a real MetaWorld
simulator, a real `policy-server --engine hf` and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from services.eval_api.schemas import EpisodeOut
from services.workers import replays, runner
from tests.workers.conftest import (
    SUITE,
    TASK,
    episodes_of,
    evaluation,
    fast_settings,
    make_evaluation,
)

pytestmark = pytest.mark.postgres


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.setattr(replays, "_unavailable", None)  # each test finds out for itself
    yield
    runner.close_caches()


def test_the_time_limit_follows_each_episodes_step_limit():
    settings = fast_settings()
    short, long = runner.episode_time_limit(150, settings), runner.episode_time_limit(500, settings)
    assert long - short == pytest.approx(350 * settings.seconds_per_step)
    from services.workers import tasks

    soft, hard = tasks.time_limits(settings)
    assert long < soft < hard, "the process-wide limits stay the last resort, behind every episode's own"


def test_an_episode_past_its_time_limit_fails_cleanly(sessions, policy_server):
    # 400 steps at 0.1 ms a step, with a 0.2 s connect budget: no real policy and simulator fit
    # (100 inferences and 400 MuJoCo steps take well over 0.24 s on any host).
    settings = fast_settings(seconds_per_step=1e-4, policy_retries=0, policy_connect_deadline_s=0.2,
                             policy_backoff_max_s=0.0)
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 1, max_steps=400)
    runner._environment(SUITE, TASK, 1_000_000)  # built already, as in a worker past its first episode
    result = runner.run_episode_by_id(sessions, ids[0], "w", settings)
    assert result.status == "failed" and result.failure_reason in ("policy_timeout", "env_error")
    row = episodes_of(sessions, evaluation_id)[0]
    assert (row.status, row.success, row.failure_reason) == ("failed", False, result.failure_reason)
    limit = runner.episode_time_limit(400, settings)
    assert f"time limit of {limit:.1f} s (400 steps × 0.0001 s per step" in row.error_message, row.error_message
    assert "EVALFORGE_SECONDS_PER_STEP" in row.error_message
    assert row.steps is not None and 1 <= row.steps < 400, "stopped inside the loop, not after it"
    assert evaluation(sessions, evaluation_id).finalised


def _skip_unless_rendering_works() -> None:
    env = runner._environment(SUITE, TASK, 1_000_000)
    env.reset()
    try:
        env.render_images({"corner": (replays.FRAME_HEIGHT, replays.FRAME_WIDTH)})
    except Exception as exc:  # what MuJoCo raises without an OpenGL context varies by backend
        pytest.skip(f"MuJoCo cannot render offscreen on this host ({type(exc).__name__}: {exc}); "
                    "install Mesa's EGL or OSMesa to run the replay test")


def test_the_first_episodes_get_a_replay_gif_linked_from_their_row(sessions, policy_server, tmp_path):
    _skip_unless_rendering_works()
    settings = fast_settings(replay_episodes=1, replay_every=2, artifact_root=tmp_path)
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)
    results = [runner.run_episode_by_id(sessions, i, "w", settings) for i in ids]
    assert all(r.failure_reason is None for r in results), results
    first, second = episodes_of(sessions, evaluation_id)
    assert first.artifact_path == f"evaluations/{evaluation_id}/episode-00000.gif"
    assert second.artifact_path is None, "only the first replay_episodes episodes are recorded"
    with Image.open(tmp_path / first.artifact_path) as gif:
        assert gif.format == "GIF" and gif.size == (replays.FRAME_WIDTH, replays.FRAME_HEIGHT)
        # A frame before every second action (steps 0, 2, …) and one of the final state.
        assert gif.n_frames == len(range(0, first.steps, 2)) + 1 > 1
        frames = []
        for i in range(gif.n_frames):
            gif.seek(i)
            frames.append(np.asarray(gif.convert("RGB")))
    assert frames[0].std() > 10, "a picture, not a blank frame"
    assert any(not np.array_equal(frames[0], f) for f in frames[1:]), "the arm moves during the episode"
    assert EpisodeOut.model_validate(first).artifact_path == first.artifact_path


def test_rendering_failure_skips_the_replay_not_the_episode(sessions, policy_server, tmp_path, monkeypatch,
                                                            caplog):
    env = runner._environment(SUITE, TASK, 1_000_000)

    def no_opengl(cameras):
        raise RuntimeError("no OpenGL context (test)")

    monkeypatch.setattr(env, "render_images", no_opengl)
    settings = fast_settings(replay_episodes=2, artifact_root=tmp_path)
    evaluation_id, ids = make_evaluation(sessions, policy_server.ws_url, 2)
    with caplog.at_level("WARNING", logger="evalforge.workers.replays"):
        results = [runner.run_episode_by_id(sessions, i, "w", settings) for i in ids]
    assert all(r.status in ("succeeded", "failed") and r.failure_reason is None for r in results), results
    assert [row.artifact_path for row in episodes_of(sessions, evaluation_id)] == [None, None]
    warnings = [r.getMessage() for r in caplog.records if "replays are off" in r.getMessage()]
    assert len(warnings) == 1 and "no OpenGL context (test)" in warnings[0], warnings
    assert not any(tmp_path.iterdir())
