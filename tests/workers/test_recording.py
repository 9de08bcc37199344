"""Rollout recording end to end: real MetaWorld episodes played by the runner against a real
`policy-server --engine hf`, on PostgreSQL; their recordings joined by the API into a LeRobot v3
dataset that `evalforge eval dataset` writes, our reader loads, LeRobot's schema matches (LeRobot
itself loads it where it is installed) and `trainer vla` trains on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from benchmarks.registry import get_suite
from lerobot_format import DemonstrationDataset
from services.cli import main
from services.store import queries
from services.store.provenance import protocol_differences
from services.workers import recording, replays, runner
from tests.eval_api.conftest import make_api
from tests.eval_api.test_client_cli import serve
from tests.workers.conftest import (
    MAX_STEPS,
    REGISTERED_SHA,
    SUITE,
    TASK,
    episodes_of,
    fast_settings,
)

pytestmark = pytest.mark.postgres

CAMERAS = {"corner": (32, 48)}
THEIRS = Path(__file__).parents[1] / "data" / "lerobot-0.6.1" / "written-by-lerobot-vid"


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.setattr(replays, "_unavailable", None)
    yield
    runner.close_caches()


def _evaluation(sessions, endpoint: str, record: str, episodes: int, cameras=CAMERAS, seed: int = 0) -> int:
    """A reach evaluation of ``episodes`` episodes recording ``record``, rendering ``cameras`` for the policy."""
    with sessions() as session:
        policy = queries.find_policy(session, "reach", "v1") or queries.create_policy(
            session, name="reach", version="v1", endpoint=endpoint, checkpoint_sha256=REGISTERED_SHA["sha256"],
            state_dim=39, action_dim=4, chunk_size=4, tasks=[TASK])
        specs = [queries.EpisodeSpec(task=TASK, seed=1_000_000 + seed + i, max_steps=MAX_STEPS)
                 for i in range(episodes)]
        return queries.create_evaluation(
            session, policy_id=policy.id, suite=SUITE, tasks=[TASK], episodes_per_task=episodes, seed=seed,
            max_steps=MAX_STEPS, standard=False, tags=[], episodes=specs, cameras=cameras,
            record=record).evaluation.id


def _play(sessions, evaluation_id: int, settings) -> list:
    for row in episodes_of(sessions, evaluation_id):
        result = runner.run_episode_by_id(sessions, row.id, "w", settings)
        assert result.failure_reason is None, result
    return episodes_of(sessions, evaluation_id)


def _skip_unless_rendering_works() -> None:
    env = runner._environment(SUITE, TASK, 1_000_000)
    env.reset()
    try:
        env.render_images(CAMERAS)
    except Exception as exc:  # what MuJoCo raises without an OpenGL context varies by backend
        pytest.skip(f"MuJoCo cannot render offscreen on this host ({type(exc).__name__}: {exc})")


@pytest.fixture
def served(pg_engine, tmp_path, monkeypatch):
    """The API on the workers' ARTIFACT_ROOT, served for the CLI."""
    for api in make_api(pg_engine, artifact_root=tmp_path / "artifacts"):
        with serve(api.app) as url:
            monkeypatch.setenv("EVALFORGE_API_URL", url)
            monkeypatch.setenv("EVALFORGE_API_KEY", api.key)
            yield api


def test_which_episodes_each_mode_records():
    assert [recording.is_recorded("first", i, 3) for i in range(7)] == [True, False, False, True, False, False, True]
    assert all(recording.is_recorded(mode, 5, 3) for mode in ("failures", "all"))
    assert not recording.is_recorded("none", 0, 1) and not recording.is_recorded(None, 0, 1)
    kept = {(mode, success): recording.is_kept(mode, success=success, failure_reason=None)
            for mode in ("none", "first", "failures", "all") for success in (False, True)}
    assert kept == {("none", False): False, ("none", True): False, ("first", False): True, ("first", True): True,
                    ("failures", False): True, ("failures", True): False, ("all", False): True, ("all", True): True}
    for reason in ("env_error", "policy_timeout", "worker_lost"):
        assert not recording.is_kept("all", success=False, failure_reason=reason), "cut short: not a rollout"


def test_recorded_rollouts_become_a_lerobot_dataset_that_trainer_vla_trains_on(sessions, policy_server, served,
                                                                              tmp_path, capsys):
    from tests.trainer.test_vla import recipe
    from trainer.cli import main as trainer_main

    _skip_unless_rendering_works()
    artifacts = tmp_path / "artifacts"
    settings = fast_settings(artifact_root=artifacts, seconds_per_step=5.0)  # a shared CPU: time is not tested here
    plain = _evaluation(sessions, policy_server.ws_url, "none", 2)
    recorded = _evaluation(sessions, policy_server.ws_url, "all", 2)
    plain_rows, rows = _play(sessions, plain, settings), _play(sessions, recorded, settings)

    # Recording changes no outcome (so it is no part of the protocol either).
    outcome = [(r.seed, r.success, r.steps, r.total_return) for r in plain_rows]
    assert [(r.seed, r.success, r.steps, r.total_return) for r in rows] == outcome
    with sessions() as session:
        a, b = (queries.get_evaluation(session, i) for i in (plain, recorded))
        assert protocol_differences(a, b) == []
    # record=none records nothing.
    assert all(r.recording_path is None for r in plain_rows)
    assert not (artifacts / f"evaluations/{plain}/recordings").exists()
    assert [r.recording_path for r in rows] == [recording.recording_path(recorded, i) for i in range(2)]
    assert all((artifacts / r.recording_path).is_file() for r in rows)

    out = tmp_path / "dataset"
    capsys.readouterr()
    assert main(["eval", "dataset", str(recorded), "--out", str(out)]) == 0
    assert f"wrote evaluation {recorded}'s 2 recorded episodes ({2 * MAX_STEPS} frames) to {out}" \
        in capsys.readouterr().out
    assert main(["eval", "dataset", str(plain), "--out", str(tmp_path / "none")]) == 1
    assert "has no recorded episodes (its record mode is 'none')" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()

    # (a) our reader: states, applied actions, the camera's frames, success and the task text.
    ds = DemonstrationDataset(out)
    suite = get_suite(SUITE)
    assert len(ds) == 2 and ds.tasks == [TASK] and ds.instructions[TASK] == suite.instruction(TASK)
    assert ds.evalforge["suite"] == SUITE and ds.evalforge["evaluation_id"] == recorded
    assert ds.evalforge["record"] == "all" and ds.evalforge["episode_indices"] == [0, 1]
    env = suite.make_env(TASK, rows[0].seed)
    for ep, row in zip(ds, rows, strict=True):
        assert (ep.length, ep.seed, ep.success) == (row.steps, row.seed, row.success)
        np.testing.assert_array_equal(ep.state[0], env.reset(row.seed)["state"].astype(np.float32))
        assert (ep.action >= suite.action_low_array).all() and (ep.action <= suite.action_high_array).all()
        frames = ds.frames(ep.index, "corner")
        assert frames.shape == (ep.length, *CAMERAS["corner"], 3) and frames.std() > 5, "a picture per step"
    assert ds.cameras["corner"]["dtype"] == "video"

    # (b) LeRobot's layout: the same info.json fields and video encoder block, the episode columns they write.
    info, theirs = (json.loads((root / "meta/info.json").read_text()) for root in (out, THEIRS))
    assert set(info) == set(theirs) and info["video_path"] == theirs["video_path"]
    video, their_video = info["features"]["observation.images.corner"]["info"], \
        theirs["features"]["observation.images.top"]["info"]
    assert (video["video.height"], video["video.width"]) == CAMERAS["corner"]
    size = ("video.height", "video.width")
    assert {k: v for k, v in video.items() if k not in size} == {k: v for k, v in their_video.items() if k not in size}
    their_columns = {f.name: f.type for f in pq.read_schema(THEIRS / "meta/episodes/chunk-000/file-000.parquet")
                     if "observation.images" not in f.name}
    our_columns = {f.name: f.type for f in pq.read_schema(out / "meta/episodes/chunk-000/file-000.parquet")}
    assert {c: our_columns.get(c) for c in their_columns} == their_columns
    if importlib.util.find_spec("lerobot") is not None:  # not in this venv (it needs Python >= 3.12)
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        theirs_loaded = LeRobotDataset("evalforge/recorded", root=out)
        assert theirs_loaded.num_episodes == 2 and theirs_loaded.num_frames == 2 * MAX_STEPS

    # (c) trainer vla trains on it (a state policy; the camera is in the dataset, unread).
    config = recipe(tmp_path / "train", out, schedule={"train_steps": 2}, policy={"export": False},
                    training={"micro_batch_size": 2, "global_batch_size": 2, "seed": 0})
    assert trainer_main(["vla", "--config", str(config)]) == 0
    card = json.loads((tmp_path / "train" / "run" / "policy.json").read_text())
    assert [t["name"] for t in card["tasks"]] == [TASK]


def test_first_records_each_tasks_first_episode_and_failures_those_that_ran_out_of_steps(sessions, policy_server,
                                                                                         tmp_path):
    """State only (no cameras): the recording has states and actions and no camera."""
    artifacts = tmp_path / "artifacts"
    settings = fast_settings(artifact_root=artifacts, seconds_per_step=5.0)  # a shared CPU: time is not tested here
    first = _play(sessions, _evaluation(sessions, policy_server.ws_url, "first", 3, cameras=None), settings)
    assert [r.recording_path is not None for r in first] == [True, False, False]
    failures = _play(sessions, _evaluation(sessions, policy_server.ws_url, "failures", 2, cameras=None, seed=7),
                     settings)
    assert [r.success for r in failures] == [False, False], "an untrained policy does not reach in 8 steps"
    assert all(r.recording_path is not None for r in failures)

    from services.eval_api.datasets import build_dataset

    with sessions() as session:
        evaluation = queries.get_evaluation(session, failures[0].evaluation_id)
        build_dataset(tmp_path / "ds", evaluation, queries.recorded_episodes(session, evaluation.id), artifacts)
    ds = DemonstrationDataset(tmp_path / "ds")
    assert ds.cameras == {} and [(ep.seed, ep.success, ep.length) for ep in ds] == \
        [(r.seed, False, r.steps) for r in failures]
