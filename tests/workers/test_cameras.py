"""Cameras through the workers: a vision policy behind a real `policy-server --engine hf` that declares
cameras, on MetaWorld's pixel suite (goal only in the image), through the runner function and PostgreSQL.

The server refuses an infer request whose images are missing or of another size, so an episode that
ends without a failure proves the frames arrived as the policy asked; a spy on the simulator's own
``render_images`` counts when they were rendered.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks.registry import get_suite
from policy_format import checkpoint_digest
from services.protocol.client import PolicyClient
from services.store import queries
from services.workers import replays, rollout, runner
from tests.workers.conftest import episodes_of, fast_settings, start_policy_server
from trainer.cli import main as trainer_main

pytestmark = pytest.mark.postgres

SUITE, TASK = "metaworld-mt1-reach-pixels", "reach-v3"
CAMERAS = {"corner": (64, 64), "gripper": (48, 64)}
MAX_STEPS = 8  # a 4-action chunk: two inferences


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.setattr(replays, "_unavailable", None)
    yield
    runner.close_caches()


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vision") / "policy"
    trainer_main(["init-policy", "--suite", SUITE, "--out", str(out), "--force",
                  "--cameras", "corner,gripper", "--image-size", "64"])
    return out


@pytest.fixture(scope="module")
def vision_server(vision_checkpoint, tmp_path_factory):
    server = start_policy_server(vision_checkpoint, tmp_path_factory.mktemp("vision-logs"))
    yield server
    server.stop()


def _evaluation(sessions, endpoint: str, sha256: str, cameras: dict, episodes: int = 1,
                policy_cameras: dict | None = None) -> tuple[int, list[int]]:
    with sessions() as session:
        policy = queries.create_policy(
            session, name="vision", version=f"v{time.monotonic_ns()}", endpoint=endpoint,
            checkpoint_sha256=sha256, state_dim=36, action_dim=4, chunk_size=4, tasks=[TASK],
            cameras=policy_cameras if policy_cameras is not None else cameras)
        specs = [queries.EpisodeSpec(task=TASK, seed=1_000_000 + i, max_steps=MAX_STEPS) for i in range(episodes)]
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite=SUITE, tasks=[TASK], episodes_per_task=episodes, seed=0,
            max_steps=MAX_STEPS, standard=False, tags=[], episodes=specs, cameras=cameras)
        return created.evaluation.id, created.episode_ids


def _count_renders(monkeypatch) -> list[dict]:
    """Spy on the cached simulator's own ``render_images``: the camera maps it was asked for."""
    env = runner._environment(SUITE, TASK, 1_000_000)
    calls: list[dict] = []
    real = env.render_images

    def spy(cameras):
        calls.append(dict(cameras))
        return real(cameras)

    monkeypatch.setattr(env, "render_images", spy)
    return calls


def test_the_server_announces_its_cameras(vision_server):
    with PolicyClient(vision_server.ws_url) as client:
        assert client.metadata.cameras == {"corner": (64, 64), "gripper": (64, 64)}
        assert client.metadata.state_dim == get_suite(SUITE).state_dim == 36


def test_frames_are_rendered_only_at_the_steps_the_policy_is_asked(sessions, vision_server, vision_checkpoint,
                                                                   monkeypatch):
    cameras = {"corner": (64, 64), "gripper": (64, 64)}
    evaluation_id, ids = _evaluation(sessions, vision_server.ws_url, checkpoint_digest(vision_checkpoint), cameras)
    calls = _count_renders(monkeypatch)
    result = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
    assert result.failure_reason is None, result
    row = episodes_of(sessions, evaluation_id)[0]
    assert row.steps == MAX_STEPS
    # 8 steps from 4-action chunks: two inferences, so two renders of both cameras, none in between.
    assert calls == [cameras, cameras]


def test_a_state_only_evaluation_renders_nothing(sessions, vision_server, vision_checkpoint, monkeypatch):
    """The same simulator with no cameras asked for: not one frame is drawn (the policy then refuses
    the image-less request, which is the server's check working, not the worker's)."""
    evaluation_id, ids = _evaluation(sessions, vision_server.ws_url, checkpoint_digest(vision_checkpoint), {},
                                     policy_cameras={})
    calls = _count_renders(monkeypatch)
    result = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
    assert calls == []
    assert result.failure_reason == "policy_error"
    assert "corner" in episodes_of(sessions, evaluation_id)[0].error_message


def test_frames_of_another_size_are_refused_by_the_server_naming_the_camera(sessions, vision_server,
                                                                           vision_checkpoint):
    evaluation_id, ids = _evaluation(sessions, vision_server.ws_url, checkpoint_digest(vision_checkpoint),
                                     CAMERAS)
    result = runner.run_episode_by_id(sessions, ids[0], "w", fast_settings())
    assert result.failure_reason == "policy_error"
    message = episodes_of(sessions, evaluation_id)[0].error_message
    assert "gripper" in message and "64" in message and "invalid_image" in message


def test_the_replay_shows_the_policys_camera_or_the_overview(sessions, vision_server, vision_checkpoint,
                                                             tmp_path):
    cameras = {"gripper": (64, 64), "corner": (64, 64)}
    sha256 = checkpoint_digest(vision_checkpoint)
    for choice, size in (("policy", (64, 64)), ("overview", (replays.FRAME_WIDTH, replays.FRAME_HEIGHT))):
        evaluation_id, ids = _evaluation(sessions, vision_server.ws_url, sha256, cameras)
        settings = fast_settings(replay_episodes=1, artifact_root=tmp_path / choice, replay_camera=choice)
        result = runner.run_episode_by_id(sessions, ids[0], "w", settings)
        assert result.failure_reason is None, result
        path = episodes_of(sessions, evaluation_id)[0].artifact_path
        with Image.open(tmp_path / choice / path) as gif:
            assert gif.size == size
            first = np.asarray(gif.convert("RGB"))
        if choice == "policy":  # of the two, the camera the suite lists first: what the policy saw of it
            first_camera = get_suite(SUITE).cameras[0].name
            env = get_suite(SUITE).make_env(TASK, 1_000_000)
            env.reset()
            seen = env.render_images({first_camera: (64, 64)})[first_camera]
            env.close()
            # The GIF's palette quantises colours: close to the frame, not equal to it.
            assert np.abs(first.astype(int) - seen.astype(int)).mean() < 12


def test_the_sequential_rollout_shows_the_policy_its_cameras(vision_server):
    results = rollout.rollout(vision_server.ws_url, SUITE, [TASK], 1, max_steps=MAX_STEPS)
    assert [r["failure_reason"] for r in results] == [None]
    assert results[0]["inferences"] == 2

