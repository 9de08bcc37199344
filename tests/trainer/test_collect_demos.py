"""trainer collect-demos and trainer.data.lerobot: layout, stats, read-back, resume, refusals."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trainer.collect_demos as cd
from benchmarks.registry import get_suite
from benchmarks.suite import EpisodeEnv, Suite, TaskSpec, canonical_observation
from trainer.collect_demos import CollectionError, collect_demos
from trainer.data.lerobot import DatasetError, DemonstrationDataset, Episode, write_dataset

REACH = "metaworld-mt1-reach"


@pytest.fixture(scope="module")
def reach_demos(tmp_path_factory) -> tuple[Path, cd.CollectionReport]:
    out = tmp_path_factory.mktemp("demos") / "reach"
    report = collect_demos(REACH, out, 2, workers=1, show_progress=False)
    return out, report


def data_table(root: Path) -> pa.Table:
    return pq.read_table(root / "data/chunk-000/file-000.parquet")


# --------------------------------------------------------------------------- the MetaWorld run


def test_layout_info_and_tasks(reach_demos):
    out, report = reach_demos
    assert report.episodes == 2 and report.new_attempts == 2 and report.rewritten
    for rel in ("meta/info.json", "meta/stats.json", "meta/tasks.parquet", "meta/evalforge.json",
                "meta/episodes/chunk-000/file-000.parquet", "data/chunk-000/file-000.parquet"):
        assert (out / rel).is_file(), rel
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 80 and isinstance(info["fps"], int)
    assert info["data_files_size_in_mb"] > 0 and info["video_files_size_in_mb"] > 0
    assert not (out / ".collect").exists() and (out.parent / "reach.collect" / "run.json").is_file()
    assert info["total_episodes"] == 2 and info["total_tasks"] == 1
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    feats = info["features"]
    assert feats["observation.state"]["dtype"] == "float32" and feats["observation.state"]["shape"] == [39]
    assert len(feats["observation.state"]["names"]) == 39
    assert feats["action"] == {"dtype": "float32", "shape": [4],
                               "names": ["hand_dx", "hand_dy", "hand_dz", "gripper_effort"]}
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert feats[name]["shape"] == [1]
    evalforge = json.loads((out / "meta/evalforge.json").read_text())
    assert evalforge["suite"] == REACH and evalforge["expert"]["reach-v3"]["successes"] == 2
    assert evalforge["task_names"] == {"reach the goal position": "reach-v3"}
    tasks = pq.read_table(out / "meta/tasks.parquet").to_pydict()
    assert tasks == {"task_index": [0], "task": ["reach the goal position"]}  # the text a policy reads

    episodes = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(e["episode_index"], e["tasks"], e["seed"], e["success"]) for e in episodes] == [
        (0, ["reach the goal position"], 0, True), (1, ["reach the goal position"], 1, True)]
    assert episodes[0]["dataset_from_index"] == 0
    assert episodes[0]["dataset_to_index"] == episodes[1]["dataset_from_index"] == episodes[0]["length"]
    assert info["total_frames"] == episodes[1]["dataset_to_index"]

    table = data_table(out)
    assert table.num_rows == info["total_frames"]
    np.testing.assert_array_equal(table.column("index").to_numpy(), np.arange(table.num_rows))
    frame = table.column("frame_index").to_numpy()
    np.testing.assert_allclose(table.column("timestamp").to_numpy(), frame / 80.0, rtol=1e-6)
    done = table.column("next.done").to_numpy(zero_copy_only=False)
    assert done.sum() == 2 and done[-1]


def test_stats_match_the_data(reach_demos):
    out, _ = reach_demos
    stats = json.loads((out / "meta/stats.json").read_text())
    table = data_table(out)
    for feature, dim in (("observation.state", 39), ("action", 4)):
        values = np.stack(table.column(feature).to_numpy(zero_copy_only=False)).astype(np.float64)
        s = stats[feature]
        assert set(s) >= {"min", "max", "mean", "std", "count", "q01", "q99"}
        assert s["count"] == [len(values)]
        for name, expected in (("min", values.min(0)), ("max", values.max(0)), ("mean", values.mean(0)),
                               ("std", values.std(0)), ("q01", np.quantile(values, 0.01, axis=0)),
                               ("q99", np.quantile(values, 0.99, axis=0))):
            assert len(s[name]) == dim
            np.testing.assert_allclose(s[name], expected, rtol=1e-6, atol=1e-9, err_msg=f"{feature} {name}")
    assert np.all(np.abs(stats["action"]["max"]) <= 1.0)  # recorded actions are the clipped ones


def test_read_back_matches_the_simulator(reach_demos):
    out, _ = reach_demos
    ds = DemonstrationDataset(out)
    assert len(ds) == 2 and (ds.state_dim, ds.action_dim, ds.fps) == (39, 4, 80.0)
    assert ds.tasks == ["reach-v3"] and ds.instructions["reach-v3"] == "reach the goal position"
    suite = get_suite(REACH)
    for ep in ds:
        assert ep.task == "reach-v3" and ep.success and ep.state.dtype == np.float32
        assert ep.state.shape == (ep.length, 39) and ep.action.shape == (ep.length, 4)
        # The first frame is exactly the seed's initial state, and replaying the actions succeeds.
        with suite.make_env("reach-v3", ep.seed) as env:
            np.testing.assert_array_equal(env.reset()["state"], ep.state[0])
            for action in ep.action:
                result = env.step(action)
            assert result.success and env.steps == ep.length


def test_resume_when_complete_adds_nothing(reach_demos):
    out, _ = reach_demos
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    report = collect_demos(REACH, out, 2, workers=1, show_progress=False)
    assert report.new_attempts == 0 and not report.rewritten and report.episodes == 2
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_resume_after_interruption_and_extend(tmp_path, reach_demos):
    done, _ = reach_demos
    out = tmp_path / "reach"
    shutil.copytree(done, out)
    # As if killed after the first episode: one saved attempt, no dataset yet.
    shutil.copytree(cd.work_dir(done), cd.work_dir(out))
    (cd.work_dir(out) / "reach-v3/seed-0000001.npz").unlink()
    shutil.rmtree(out / "data")
    shutil.rmtree(out / "meta")
    report = collect_demos(REACH, out, 2, workers=1, show_progress=False)
    assert report.new_attempts == 1 and report.rewritten
    assert data_table(out).equals(data_table(done))
    report = collect_demos(REACH, out, 3, workers=1, show_progress=False)
    assert report.new_attempts == 1 and report.episodes == 3
    assert [ep.seed for ep in DemonstrationDataset(out)] == [0, 1, 2]


def test_parallel_workers_write_the_same_dataset(tmp_path, reach_demos):
    done, _ = reach_demos
    report = collect_demos(REACH, tmp_path / "par", 2, workers=2, show_progress=False)
    assert report.new_attempts == 2
    assert data_table(tmp_path / "par").equals(data_table(done))


def test_cli_arguments(tmp_path, reach_demos):
    done, _ = reach_demos
    parser = argparse.ArgumentParser()
    cd.add_arguments(parser)
    out = tmp_path / "cli"
    shutil.copytree(done, out)
    shutil.copytree(cd.work_dir(done), cd.work_dir(out))
    args = parser.parse_args(["--suite", REACH, "--episodes-per-task", "2", "--out", str(out), "--workers", "1"])
    report = cd.run(args)
    assert report.new_attempts == 0
    args = parser.parse_args(["--suite", "pusht", "--episodes-per-task", "2", "--out", str(tmp_path / "p")])
    with pytest.raises(SystemExit, match="pusht has no scripted expert"):
        cd.run(args)
    assert not (tmp_path / "p").exists()


# --------------------------------------------------------------------------- refusals


def test_refuses_bad_arguments_and_foreign_directories(tmp_path, reach_demos):
    done, _ = reach_demos
    with pytest.raises(CollectionError, match="evaluation seeds start at 1,000,000"):
        collect_demos(REACH, tmp_path / "a", 2, seed=999_995)
    with pytest.raises(CollectionError, match="at least 1"):
        collect_demos(REACH, tmp_path / "a", 0)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CollectionError, match="not written by collect-demos"):
        collect_demos(REACH, foreign, 2, workers=1, show_progress=False)
    with pytest.raises(CollectionError, match="holds a collection for suite metaworld-mt1-reach from seed 0"):
        collect_demos("metaworld-mt1-push", done, 2, workers=1, show_progress=False)
    with pytest.raises(CollectionError, match="from seed 0"):
        collect_demos(REACH, done, 2, seed=10, workers=1, show_progress=False)


# --------------------------------------------------------------------------- failing experts (a toy suite)


class CoinEnv(EpisodeEnv):
    """A toy task the 'expert' solves in 3 steps unless seed % 3 == 0, when it never does."""

    def _reset(self, seed: int) -> dict[str, Any]:
        return canonical_observation(np.array([seed, 0.0]), self.task)

    def _step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        success = self.seed % 3 != 0 and self.steps + 1 >= 3
        return canonical_observation(np.array([self.seed, self.steps + 1.0]), self.task), 1.0, success, {}

    def close(self) -> None:
        pass


COIN = Suite(name="toy-coin", simulator="none", description="toy", tasks=(TaskSpec("flip", "flip", 5),),
             state_dim=2, action_dim=1, action_low=(-1.0,), action_high=(1.0,), fps=10.0,
             env_factory=lambda suite, task, seed: CoinEnv(suite, task, seed),
             expert_factory=lambda suite, task: lambda obs: np.ones(1, np.float32))


def test_only_successes_are_kept_and_rates_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(cd, "get_suite", lambda name: COIN)
    report = collect_demos("toy-coin", tmp_path / "coin", 4, workers=1, show_progress=False)
    # Seeds 0 and 3 fail; 1, 2, 4, 5 succeed: six attempts for four episodes.
    (task,) = report.tasks
    assert (task.attempts, task.successes, task.kept) == (6, 4, 4)
    assert task.success_rate == pytest.approx(4 / 6)
    ds = DemonstrationDataset(tmp_path / "coin")
    assert [ep.seed for ep in ds] == [1, 2, 4, 5] and all(ep.length == 3 for ep in ds)
    # A cap on attempts leaves the task short and says so, without failing.
    report = collect_demos("toy-coin", tmp_path / "capped", 4, max_attempts=4, workers=1, show_progress=False)
    assert report.short_tasks == ["flip"] and report.tasks[0].kept == 2


def test_plan_attempts_the_shortest_seed_prefix():
    ok = cd.Attempt("t", 0, True, 1)
    bad = cd.Attempt("t", 0, False, 1)
    assert cd._plan({}, set(), 3, 10, 100) == [10, 11, 12]
    assert cd._plan({10: bad}, {11, 12}, 3, 10, 100) == [13]
    assert cd._plan({10: ok, 12: ok}, {11}, 3, 10, 100) == []  # 11 may still succeed
    assert cd._plan({11: ok, 12: ok}, set(), 2, 10, 100) == [10]  # a hole left by an interruption
    assert cd._plan({10: bad, 11: bad}, set(), 3, 10, 3) == [12]  # the cap


# --------------------------------------------------------------------------- bad datasets


@pytest.fixture
def dataset_copy(tmp_path, reach_demos) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(reach_demos[0], out)
    return out


@pytest.mark.parametrize("missing", ["meta/info.json", "meta/stats.json", "meta/tasks.parquet"])
def test_refuses_missing_metadata(dataset_copy, missing):
    (dataset_copy / missing).unlink()
    with pytest.raises(DatasetError, match=f"{missing}: missing"):
        DemonstrationDataset(dataset_copy)


def test_refuses_missing_episode_metadata_and_data(dataset_copy):
    (dataset_copy / "data/chunk-000/file-000.parquet").unlink()
    with pytest.raises(DatasetError, match=r"file-000.parquet: data file missing \(episodes \[0, 1\]"):
        DemonstrationDataset(dataset_copy)
    shutil.rmtree(dataset_copy / "meta/episodes")
    with pytest.raises(DatasetError, match="no episode metadata"):
        DemonstrationDataset(dataset_copy)


def _rewrite_state(root: Path, episode: int, frame: int, value: float) -> None:
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    state = np.stack(table.column("observation.state").to_numpy(zero_copy_only=False))
    rows = np.flatnonzero(table.column("episode_index").to_numpy() == episode)
    state[rows[frame], 7] = value
    column = pa.FixedSizeListArray.from_arrays(pa.array(state.reshape(-1)), state.shape[1])
    pq.write_table(table.set_column(0, "observation.state", column), path)


def test_refuses_nan_naming_file_and_episode(dataset_copy):
    _rewrite_state(dataset_copy, episode=1, frame=4, value=np.nan)
    with pytest.raises(DatasetError, match=r"data/chunk-000/file-000.parquet, episode 1: 'observation.state' "
                                           r"has NaN or infinity at frame 4"):
        DemonstrationDataset(dataset_copy)


def test_refuses_mismatched_dimensions(dataset_copy):
    info_path = dataset_copy / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["action"]["shape"] = [5]
    info_path.write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=r"stats.json: 'action' min has 4 values, info.json says 5"):
        DemonstrationDataset(dataset_copy)
    stats_path = dataset_copy / "meta/stats.json"
    stats = json.loads(stats_path.read_text())
    for name in ("min", "max", "mean", "std"):
        stats["action"][name] = [0.0] * 5
    stats_path.write_text(json.dumps(stats))
    with pytest.raises(DatasetError, match=r"file-000.parquet, episode 0: 'action' has 4 values at frame 0, "
                                           r"info.json says 5"):
        DemonstrationDataset(dataset_copy)


def test_refuses_episode_length_mismatch(dataset_copy):
    path = dataset_copy / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path)
    with pytest.raises(DatasetError, match=r"file-000.parquet, episode 1: \d+ frames, the episode metadata says"):
        DemonstrationDataset(dataset_copy)


def test_writer_splits_and_round_trips(tmp_path, monkeypatch):
    import lerobot_format.dataset as lr  # the module the writer reads its limits from

    monkeypatch.setattr(lr, "DATA_FILES_SIZE_MB", 0)  # one episode per data file
    rng = np.random.default_rng(0)
    episodes = [Episode(task=t, state=rng.normal(size=(n, 3)).astype(np.float32),
                        action=rng.normal(size=(n, 2)).astype(np.float32), seed=i)
                for i, (t, n) in enumerate([("a", 4), ("b", 2), ("a", 5)])]
    info = write_dataset(tmp_path / "ds", episodes, fps=10, tasks={"a": "do a", "b": "do b"})
    assert info["total_frames"] == 11
    assert (tmp_path / "ds/data/chunk-000/file-002.parquet").is_file()
    ds = DemonstrationDataset(tmp_path / "ds")
    assert [(ep.task, ep.task_index, ep.length, ep.seed) for ep in ds] == [("a", 0, 4, 0), ("b", 1, 2, 1),
                                                                         ("a", 0, 5, 2)]
    for ep, orig in zip(ds, episodes, strict=True):
        np.testing.assert_array_equal(ep.state, orig.state)
        np.testing.assert_array_equal(ep.action, orig.action)


def test_environment_state_round_trips_and_is_all_or_none(tmp_path):
    rng = np.random.default_rng(1)

    def episode(n: int, hidden: bool) -> Episode:
        return Episode(task="a", state=rng.normal(size=(n, 3)).astype(np.float32),
                       action=rng.normal(size=(n, 2)).astype(np.float32),
                       environment_state=rng.normal(size=(n, 2)).astype(np.float32) if hidden else None)

    episodes = [episode(4, True), episode(3, True)]
    info = write_dataset(tmp_path / "ds", episodes, fps=10, tasks={"a": "do a"}, environment_state_names=["gx", "gy"])
    assert info["features"]["observation.environment_state"] == {"dtype": "float32", "shape": [2],
                                                                 "names": ["gx", "gy"]}
    ds = DemonstrationDataset(tmp_path / "ds")
    assert ds.environment_state_dim == 2
    for ep, orig in zip(ds, episodes, strict=True):
        np.testing.assert_array_equal(ep.environment_state, orig.environment_state)
    together = np.concatenate([e.environment_state for e in episodes])
    np.testing.assert_allclose(ds.stats["observation.environment_state"]["max"], together.max(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="episode 1 .* has environment_state None"):
        write_dataset(tmp_path / "mixed", [episode(4, True), episode(3, False)], fps=10, tasks={"a": "do a"})
    # a dataset without it (every one written before) reads as before
    write_dataset(tmp_path / "plain", [episode(2, False)], fps=10, tasks={"a": "do a"})
    plain = DemonstrationDataset(tmp_path / "plain")
    assert plain.environment_state_dim == 0 and plain[0].environment_state is None
    assert "observation.environment_state" not in plain.info["features"]


def test_a_state_suite_records_no_environment_state(reach_demos):
    ds = DemonstrationDataset(reach_demos[0])
    assert ds.environment_state_dim == 0 and "observation.environment_state" not in ds.info["features"]


def test_old_collection_inside_the_dataset_moves_beside_it_and_is_rewritten(tmp_path):
    """A collection made before #17 (tests/data/written-by-evalforge-650ce7c: OUT/.collect, tasks.jsonl,
    info.json's "evalforge") stays readable, and resuming it moves the work folder out and rewrites the dataset."""
    old = Path(__file__).parents[1] / "data" / "written-by-evalforge-650ce7c"
    before = DemonstrationDataset(old)
    assert before.tasks == ["reach-v3"] and before.evalforge["suite"] == REACH and len(before) == 2
    out = tmp_path / "old"
    shutil.copytree(old, out)
    report = collect_demos(REACH, out, 2, workers=1, show_progress=False)
    assert report.new_attempts == 0 and report.rewritten
    assert not (out / ".collect").exists() and (cd.work_dir(out) / "reach-v3/seed-0000000.npz").is_file()
    assert not (out / "meta/tasks.jsonl").exists() and (out / "meta/tasks.parquet").is_file()
    after = DemonstrationDataset(out)
    assert after.tasks == before.tasks and after.instructions == {"reach-v3": "reach the goal position"}
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a.state, b.state)
        np.testing.assert_array_equal(a.action, b.action)


def test_a_resume_with_other_cameras_is_refused(reach_demos):
    with pytest.raises(CollectionError, match=r"recording no cameras; this run asks for cameras corner 96x96"):
        collect_demos(REACH, reach_demos[0], 2, workers=1, show_progress=False, cameras=["corner"])


def test_action_noise_plays_perturbed_actions_and_records_the_expert(tmp_path, reach_demos):
    """DART: the states leave the noise-free trajectory, every recorded action is the expert's
    action for the recorded state, the same arguments give the same data, and a resume with
    other noise is refused."""
    out = tmp_path / "noisy"
    report = collect_demos(REACH, out, 2, workers=1, show_progress=False, action_noise=0.3)
    assert report.episodes == 2
    suite = get_suite(REACH)
    expert = suite.expert("reach-v3")
    clean = {ep.seed: ep for ep in DemonstrationDataset(reach_demos[0])}
    noisy = list(DemonstrationDataset(out))
    assert DemonstrationDataset(out).evalforge["action_noise"] == 0.3
    moved = 0
    for ep in noisy:
        for state, action in zip(ep.state, ep.action, strict=True):
            np.testing.assert_allclose(action, expert({"state": state}), atol=1e-6)
        if ep.seed in clean:
            np.testing.assert_array_equal(ep.state[0], clean[ep.seed].state[0])  # same initial state
            n = min(ep.length, clean[ep.seed].length)
            moved += not np.allclose(ep.state[:n], clean[ep.seed].state[:n])
    assert moved > 0, "the noise never moved the hand off the expert's own path"
    again = list(DemonstrationDataset(collect_demos(REACH, tmp_path / "again", 2, workers=1, show_progress=False,
                                                    action_noise=0.3).out))
    for a, b in zip(noisy, again, strict=True):
        np.testing.assert_array_equal(a.state, b.state)
        np.testing.assert_array_equal(a.action, b.action)
    with pytest.raises(CollectionError, match=r"with action noise 0.3; this run asks for no cameras\. Use"):
        collect_demos(REACH, out, 2, workers=1, show_progress=False)
    with pytest.raises(CollectionError, match=r"--action-noise 1.5"):
        collect_demos(REACH, tmp_path / "big", 2, workers=1, show_progress=False, action_noise=1.5)
