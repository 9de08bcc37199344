"""Episode exports: ``GET /evaluations/{id}/episodes?format=csv|jsonl``, ``evalforge eval export`` (csv, jsonl,
parquet) and ``evalforge eval rerun``, on each store backend.

Exports are checked against the JSON API's own pages (same values, plus the evaluation's
provenance on every row); a 50,000-episode export is checked to stream: its peak traced
memory is compared with what holding its rows would take, measured on the same rows.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
import tracemalloc
from datetime import datetime

import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

from services.cli import main
from services.eval_api.exports import EXPORT_COLUMNS
from services.store import queries
from services.store.models import Episode
from tests.eval_api.conftest import POLICY_ENDPOINT, Api, make_api, metadata
from tests.eval_api.test_client_cli import GUARD_S, serve
from tests.store.helpers import add_policy

SIMULATOR_VERSIONS = {"metaworld": "3.1.1", "mujoco": "3.3.0"}


def played_evaluation(api: Api) -> int:
    """An MT10 evaluation (2 episodes per task, action horizon 2) submitted through the API; its first
    episodes played with every field a worker writes, one of them an error whose message needs quoting."""
    policy = api.register_policy()
    evaluation_id = api.submit(policy["id"], inference={"action_horizon": 2}, tags=["smoke"])["id"]
    with api.sessions() as session:
        episodes = queries.list_episodes(session, evaluation_id, limit=100)
        for number, episode in enumerate(episodes[:6]):
            assert queries.claim_episode(session, episode.id, f"worker-{number % 2}", 60)
            error = number == 5
            queries.finish_episode(
                session, episode.id, success=number % 2 == 0 and not error, total_return=0.25 * number,
                steps=40 + number, duration_s=1.5, latency_mean_ms=3.25, latency_p95_ms=7.0 + number,
                failure_reason="env_error" if error else None,
                error_message='MuJoCo said "bad qpos",\nthen stopped' if error else None,
                simulator_versions=SIMULATOR_VERSIONS, initial_state_index=number, worker_host="gpu-7",
                renderer="egl")
    return evaluation_id


def json_pages(api: Api, evaluation_id: int, **params: str) -> list[dict]:
    items, cursor = [], None
    while True:
        page = api.client.get(f"/evaluations/{evaluation_id}/episodes",
                              params={**params, "limit": 7, **({"cursor": cursor} if cursor else {})}).json()
        items += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items


def expected_rows(api: Api, evaluation_id: int, **params: str) -> list[dict]:
    """What every exported row should say: the JSON API's episode and evaluation, read independently."""
    evaluation = api.client.get(f"/evaluations/{evaluation_id}").json()
    policy = evaluation["protocol"]["policy"]
    provenance = {"evaluation_id": evaluation_id, "suite": "metaworld-mt10",
                  "definition_hash": evaluation["protocol"]["definition_hash"], "policy_name": "bc",
                  "policy_version": evaluation["policy"]["version"], "policy_checkpoint_sha256": "ab" * 32,
                  "policy_revision": None, "policy_protocol": policy["protocol"], "inference": "horizon 2"}
    assert provenance["definition_hash"] and provenance["policy_protocol"] == "evalforge"
    return [{**{column: item[column] for column in EXPORT_COLUMNS if column in item}, **provenance}
            for item in json_pages(api, evaluation_id, **params)]


def from_csv_cell(kind: str, text: str) -> object:
    """A CSV cell back to the JSON value it stands for (the rules in services/eval_api/exports.py)."""
    if text == "":
        return None
    return {"int": int, "float": float, "bool": lambda t: {"true": True, "false": False}[t],
            "json": json.loads}.get(kind, str)(text)


def test_csv_and_jsonl_exports_say_what_the_json_api_says_with_the_provenance(api):
    evaluation_id = played_evaluation(api)
    expected = expected_rows(api, evaluation_id)
    assert len(expected) == 20 and set(expected[0]) == set(EXPORT_COLUMNS)
    assert expected[0]["simulator_versions"] == SIMULATOR_VERSIONS and expected[0]["success"] is True

    jsonl = api.client.get(f"/evaluations/{evaluation_id}/episodes", params={"format": "jsonl"})
    assert jsonl.status_code == 200
    assert jsonl.headers["content-type"] == "application/x-ndjson"
    assert jsonl.headers["content-disposition"] == f'attachment; filename="evaluation-{evaluation_id}-episodes.jsonl"'
    assert [json.loads(line) for line in jsonl.text.splitlines()] == expected
    assert list(json.loads(jsonl.text.splitlines()[0])) == list(EXPORT_COLUMNS)

    response = api.client.get(f"/evaluations/{evaluation_id}/episodes", params={"format": "csv"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    assert response.headers["content-disposition"] == f'attachment; filename="evaluation-{evaluation_id}-episodes.csv"'
    reader = csv.DictReader(io.StringIO(response.text, newline=""))
    assert reader.fieldnames == list(EXPORT_COLUMNS)
    rows = [{column: from_csv_cell(EXPORT_COLUMNS[column], text) for column, text in row.items()} for row in reader]
    assert rows == expected
    assert rows[5]["error_message"] == 'MuJoCo said "bad qpos",\nthen stopped' and rows[5]["success"] is False

    succeeded = api.client.get(f"/evaluations/{evaluation_id}/episodes",
                               params={"format": "jsonl", "status": "succeeded"}).text.splitlines()
    assert [json.loads(line) for line in succeeded] == expected_rows(api, evaluation_id, status="succeeded")
    assert len(succeeded) == 3


def test_an_unknown_format_is_a_422_and_an_unknown_evaluation_a_404(api):
    evaluation_id = played_evaluation(api)
    refused = api.client.get(f"/evaluations/{evaluation_id}/episodes", params={"format": "xlsx"})
    assert refused.status_code == 422 and "format" in refused.text
    assert api.client.get("/evaluations/999/episodes", params={"format": "csv"}).status_code == 404
    page = api.client.get(f"/evaluations/{evaluation_id}/episodes", params={"limit": 3}).json()
    assert len(page["items"]) == 3 and page["next_cursor"]  # without format: the JSON pages as before


LARGE = 50_000


def test_a_large_export_streams_without_holding_its_rows(api):
    with api.sessions() as session:
        policy = add_policy(session, tasks=("reach-v3",))
        created = queries.create_evaluation(
            session, policy_id=policy.id, suite="metaworld-mt10", tasks=["reach-v3"], episodes_per_task=LARGE,
            seed=0, max_steps=None, standard=False, tags=[],
            episodes=[queries.EpisodeSpec(task="reach-v3", seed=1_000_000 + i, max_steps=500) for i in range(LARGE)])
        evaluation_id = created.evaluation.id
        session.execute(update(Episode).where(Episode.evaluation_id == evaluation_id).values(
            status="succeeded", success=True, total_return=12.5, steps=120, duration_s=2.25, latency_mean_ms=3.5,
            latency_p95_ms=8.0, attempts=1, worker_id="celery@gpu-7", worker_host="gpu-7", renderer="egl",
            simulator_versions=SIMULATOR_VERSIONS, started_at=created.evaluation.created_at,
            finished_at=created.evaluation.created_at))
        session.commit()
        # What holding the rows would take, measured: 2,000 of them loaded as the JSON API pages them.
        tracemalloc.start()
        held = queries.list_episodes(session, evaluation_id, limit=2_000)
        per_row = tracemalloc.get_traced_memory()[0] / len(held)
        tracemalloc.stop()
        del held

    for export_format in ("csv", "jsonl"):
        lines, size, tail = 0, 0, b""
        tracemalloc.start()
        with api.client.stream("GET", f"/evaluations/{evaluation_id}/episodes",
                               params={"format": export_format}) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                lines += chunk.count(b"\n")
                size += len(chunk)
                tail = (tail + chunk)[-2_000:]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert lines == LARGE + (export_format == "csv")
        last = tail.decode().splitlines()[-1]
        assert (json.loads(last)["episode_index"] if export_format == "jsonl"
                else int(next(csv.reader([last]))[1])) == LARGE - 1
        # Holding every row would take per_row × LARGE (and the body alone `size`); a stream holds a batch.
        assert peak < per_row * LARGE / 10, (export_format, peak, per_row)
        assert peak < size / 2, (export_format, peak, size)


# ---------------------------------------------------------------------------- the command line


@pytest.fixture
def served_api(store_engine, monkeypatch):
    for api in make_api(store_engine):
        api.handshake.servers[POLICY_ENDPOINT] = metadata()
        with serve(api.app) as url:
            monkeypatch.setenv("EVALFORGE_API_URL", url)
            monkeypatch.setenv("EVALFORGE_API_KEY", api.key)
            yield api


def test_eval_export_writes_csv_jsonl_and_parquet_files(served_api, tmp_path, capsys):
    evaluation_id = played_evaluation(served_api)
    expected = expected_rows(served_api, evaluation_id)
    for export_format in ("csv", "jsonl", "parquet"):
        out = tmp_path / f"episodes.{export_format}"
        capsys.readouterr()
        assert main(["eval", "export", str(evaluation_id), "--format", export_format, "--out", str(out)]) == 0
        assert f"wrote evaluation {evaluation_id}'s episodes to {out} ({export_format}" in capsys.readouterr().out
        assert not (tmp_path / f"episodes.{export_format}.partial").exists()
    assert (tmp_path / "episodes.jsonl").read_bytes() == served_api.client.get(
        f"/evaluations/{evaluation_id}/episodes", params={"format": "jsonl"}).content
    assert (tmp_path / "episodes.csv").read_bytes() == served_api.client.get(
        f"/evaluations/{evaluation_id}/episodes", params={"format": "csv"}).content

    table = pq.read_table(tmp_path / "episodes.parquet")
    assert table.column_names == list(EXPORT_COLUMNS)
    assert str(table.schema.field("finished_at").type) == "timestamp[us, tz=UTC]"
    read_back = table.to_pylist()
    for row in read_back:
        row["simulator_versions"] = json.loads(row["simulator_versions"]) if row["simulator_versions"] else None
        for column in ("started_at", "finished_at"):
            row[column] = row[column].isoformat() if row[column] else None
    assert read_back == [{**row, **{column: datetime.fromisoformat(row[column]).isoformat() if row[column] else None
                                    for column in ("started_at", "finished_at")}} for row in expected]


def test_eval_export_of_an_unknown_evaluation_names_it_and_writes_nothing(served_api, tmp_path, capsys):
    (folder := tmp_path / "exports").mkdir()
    capsys.readouterr()
    assert main(["eval", "export", "999", "--format", "csv", "--out", str(folder / "episodes.csv")]) == 1
    assert "no evaluation with id 999" in capsys.readouterr().err
    assert list(folder.iterdir()) == []


PROTOCOL_FIELDS = ("policy", "suite", "tasks", "episodes_per_task", "seed", "max_steps", "cameras", "inference")


def test_eval_rerun_submits_the_same_protocol_and_compares_with_watch(served_api, capsys):
    policy = served_api.register_policy()
    original = served_api.submit(policy["id"], episodes_per_task=3, seed=11, tasks=["reach-v3", "push-v3"],
                                 max_steps=120, tags=["nightly"], inference={"temporal_ensemble": 0.05})
    capsys.readouterr()
    assert main(["eval", "rerun", str(original["id"]), "--json"]) == 0
    rerun = json.loads(capsys.readouterr().out)
    assert rerun["id"] != original["id"] and rerun["status"] == "pending"
    assert {f: rerun[f] for f in PROTOCOL_FIELDS} == {f: original[f] for f in PROTOCOL_FIELDS}
    assert rerun["tags"] == sorted(["nightly", f"rerun-of:{original['id']}"])
    assert rerun["protocol"]["definition_hash"] == original["protocol"]["definition_hash"]
    assert rerun["protocol"]["seeds"] == original["protocol"]["seeds"]


    def play_like_the_original(evaluation_id: int) -> None:  # a deterministic policy
        with served_api.sessions() as session:
            for episode in queries.list_episodes(session, evaluation_id, limit=100):
                assert queries.claim_episode(session, episode.id, "w", 60)
                queries.finish_episode(session, episode.id, success=episode.seed % 2 == 0, steps=10)
            queries.finalize_evaluation_if_done(session, evaluation_id)

    def play_the_next_rerun() -> None:
        """A worker: plays the rerun that `--watch` below submits, as soon as it appears."""
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            with served_api.sessions() as session:
                newest = queries.list_evaluations(session, limit=1)[0].id
            if newest not in (original["id"], rerun["id"]):
                play_like_the_original(newest)
                return
            time.sleep(0.02)

    play_like_the_original(original["id"])
    worker = threading.Thread(target=play_the_next_rerun)
    worker.start()
    capsys.readouterr()
    try:
        code = main(["eval", "rerun", str(original["id"]), "--watch", "--poll", "0.05", "--watch-timeout", "60"])
    finally:
        worker.join(GUARD_S)
    out = capsys.readouterr().out
    assert code == 0, out
    newest = rerun["id"] + 1
    assert f"submitted evaluation {newest}: a rerun of evaluation {original['id']}" in out
    assert f"candidate {newest} (bc:" in out and f"vs baseline {original['id']}" in out
    assert "verdict: no detectable difference at n = 6" in out
