"""``record`` through the API (POST /evaluations, the evaluation and episode bodies) and
``GET /evaluations/{id}/dataset``, on each store backend, with recordings written as workers write them."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from sqlalchemy import update

from lerobot_format import DemonstrationDataset, Episode
from lerobot_format.episode_file import save_episode
from services.store.models import Episode as EpisodeRow
from tests.eval_api.conftest import make_api


@pytest.fixture
def api(store_engine, tmp_path):
    yield from make_api(store_engine, artifact_root=tmp_path / "artifacts")


def test_record_is_stored_shown_and_checked(api):
    policy = api.register_policy()
    assert api.submit(policy["id"])["record"] == "none"
    evaluation = api.submit(policy["id"], record="failures")
    assert evaluation["record"] == "failures"
    assert api.client.get(f"/evaluations/{evaluation['id']}").json()["record"] == "failures"
    refused = api.submit(policy["id"], record="some", expect=422)
    assert "record" in str(refused)
    episode = api.client.get(f"/evaluations/{evaluation['id']}/episodes").json()["items"][0]
    assert episode["recording_path"] is None


def test_the_dataset_joins_the_recorded_episodes_in_index_order(api, tmp_path):
    policy = api.register_policy()
    evaluation_id = api.submit(policy["id"], record="all", tasks=["reach-v3", "push-v3"], episodes_per_task=2)["id"]
    missing = api.client.get(f"/evaluations/{evaluation_id}/dataset")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "no_recordings"
    rng = np.random.default_rng(0)
    lengths = {1: 5, 2: 3}  # reach's second episode, push's first
    with api.sessions() as session:
        for index, length in lengths.items():
            task = "reach-v3" if index < 2 else "push-v3"
            relative = f"evaluations/{evaluation_id}/recordings/episode-{index:05d}.npz"
            save_episode(tmp_path / "artifacts" / relative,
                         Episode(task=task, state=rng.normal(size=(length, 39)).astype(np.float32),
                                 action=rng.uniform(-1, 1, size=(length, 4)).astype(np.float32), success=index == 2,
                                 seed=index),
                         fps=80, instruction=f"do {task}", extra={"state_names": [], "action_names": []})
            session.execute(update(EpisodeRow).where(EpisodeRow.evaluation_id == evaluation_id,
                                                     EpisodeRow.episode_index == index)
                            .values(recording_path=relative))
        session.commit()
    response = api.client.get(f"/evaluations/{evaluation_id}/dataset")
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        assert "meta/info.json" in tar.getnames()
        tar.extractall(tmp_path / "ds", filter="data")
    ds = DemonstrationDataset(tmp_path / "ds")
    assert [(ep.task, ep.length, ep.success, ep.seed) for ep in ds] == [("reach-v3", 5, False, 1),
                                                                       ("push-v3", 3, True, 2)]
    assert ds.instructions == {"reach-v3": "do reach-v3", "push-v3": "do push-v3"}
    assert ds.evalforge["episode_indices"] == [1, 2] and ds.evalforge["suite"] == "metaworld-mt10"

    (tmp_path / "artifacts" / f"evaluations/{evaluation_id}/recordings/episode-00002.npz").unlink()
    gone = api.client.get(f"/evaluations/{evaluation_id}/dataset")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "recording_unavailable"
    assert "ARTIFACT_ROOT" in gone.json()["error"]["message"]
    assert api.client.get("/evaluations/999999/dataset").status_code == 404


def test_eval_dataset_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    from services.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("keep me")
    assert main(["eval", "dataset", "1", "--out", str(tmp_path / "data"), "--api-url", "http://127.0.0.1:9"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["mine.txt"]
