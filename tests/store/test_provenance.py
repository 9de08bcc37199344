"""The store's provenance: protocol records, comparability, episode hosts, leaderboard versions, older rows."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from sqlalchemy import select, text

from services.store import migrate, provenance, queries
from services.store.db import create_db_engine, make_session_factory
from services.store.models import Episode, Evaluation, Policy
from services.store.provenance import build_protocol, protocol_differences
from tests.store.helpers import TASKS, add_policy, run_all

REPO = Path(__file__).resolve().parents[2]
HASH_A, HASH_B = "a" * 64, "b" * 64


def _policy() -> Policy:
    return Policy(id=7, name="bc", version="v1", protocol="evalforge", checkpoint_sha256="ab" * 32, revision=None)


def _protocol(*, definition_hash: str = HASH_A, limits: dict[str, int] | None = None, seed: int = 0,
              per_task: int = 2, cameras: dict | None = None, inference: dict | None = None) -> dict:
    limits = limits or {task: 500 for task in TASKS}
    return build_protocol(suite="metaworld-mt10", definition_hash=definition_hash, simulator="metaworld",
                          seed_rule="seed -> rule", step_limits=list(limits.items()), seed=seed,
                          episodes_per_task=per_task, first_seed=1_000_000 + seed, cameras=cameras,
                          inference=inference, policy=_policy())


def _evaluation(*, recorded: bool = True, suite: str = "metaworld-mt10", tasks: tuple[str, ...] = TASKS,
                seed: int = 0, per_task: int = 2, max_steps: int | None = None, limits: dict | None = None,
                cameras: dict | None = None, inference: dict | None = None,
                definition_hash: str = HASH_A) -> Evaluation:
    """An evaluation row as the API writes it (``recorded``) or as one made before protocols were."""
    protocol = (_protocol(definition_hash=definition_hash, limits=limits or {t: max_steps or 500 for t in tasks},
                          seed=seed, per_task=per_task, cameras=cameras, inference=inference) if recorded else None)
    return Evaluation(suite=suite, tasks=list(tasks), seed=seed, episodes_per_task=per_task, max_steps=max_steps,
                      cameras=cameras, inference=inference, protocol=protocol,
                      definition_hash=definition_hash if recorded else None)


# ---------------------------------------------------------------------------- the record


def test_the_protocol_record_names_the_policy_and_the_software_that_made_it():
    protocol = _protocol(cameras={"corner": (96, 96)}, inference={"action_horizon": 2})
    assert protocol["tasks"] == [{"name": "reach-v3", "max_steps": 500}, {"name": "push-v3", "max_steps": 500}]
    assert protocol["seeds"] == {"seed": 0, "episodes_per_task": 2, "first_seed": 1_000_000, "rule": "seed -> rule"}
    assert protocol["cameras"] == {"corner": [96, 96]}
    assert protocol["inference"] == {"action_horizon": 2, "temporal_ensemble": None}
    assert protocol["policy"] == {"id": 7, "name": "bc", "version": "v1", "protocol": "evalforge",
                                  "checkpoint_sha256": "ab" * 32, "revision": None}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    assert protocol["evalforge"] == {"version": metadata.version("evalforge"), "source_commit": head or None}
    line = provenance.provenance_line(protocol)
    assert line.startswith("suite definition aaaaaaaaaaaa · horizon 2 · policy evalforge abababababab · evalforge ")
    assert provenance.provenance_line(None).startswith("protocol not recorded")


# ---------------------------------------------------------------------------- comparability


def test_evaluations_of_one_protocol_are_comparable_whatever_their_policy():
    baseline = _evaluation(cameras={"corner": [96, 96]}, inference={"action_horizon": 1})
    candidate = _evaluation(cameras={"corner": [96, 96]}, inference={"action_horizon": 1})
    candidate.protocol["policy"] = {**candidate.protocol["policy"], "id": 8, "name": "other"}
    candidate.tasks = list(reversed(TASKS))  # the same tasks in another order pair the same episodes
    assert protocol_differences(baseline, candidate) == []


@pytest.mark.parametrize("change,expected", [
    ({"suite": "metaworld-mt50"}, "suite: baseline metaworld-mt10, candidate metaworld-mt50"),
    ({"definition_hash": HASH_B}, "suite definition: baseline aaaaaaaaaaaa, candidate bbbbbbbbbbbb"),
    ({"tasks": ("reach-v3",)}, "tasks: baseline 2, candidate 1; only in baseline: push-v3"),
    ({"seed": 100}, "seeds: baseline seed 0 × 2 episodes per task (first simulator seed 1000000), candidate seed "
                    "100 × 2 episodes per task (first simulator seed 1000100)"),
    ({"per_task": 3}, "seeds: baseline seed 0 × 2 episodes per task (first simulator seed 1000000), candidate seed "
                      "0 × 3 episodes per task (first simulator seed 1000000)"),
    ({"limits": {"reach-v3": 500, "push-v3": 150}}, "max_steps: push-v3 baseline 500, candidate 150"),
    ({"cameras": {"gripper": [64, 64], "corner": [96, 96]}},
     "cameras: baseline none (state only), candidate corner 96×96, gripper 64×64"),
    ({"inference": {"action_horizon": 1}}, "inference: baseline whole chunk, candidate horizon 1"),
    ({"inference": {"temporal_ensemble": 0.01}}, "inference: baseline whole chunk, candidate ensemble m=0.01"),
], ids=["suite", "definition", "tasks", "seed", "episodes_per_task", "max_steps", "cameras", "horizon", "ensemble"])
def test_each_difference_is_named_with_both_values(change, expected):
    assert protocol_differences(_evaluation(), _evaluation(**change)) == [expected]


def test_every_difference_is_listed_in_order():
    candidate = _evaluation(tasks=("reach-v3",), seed=5, inference={"action_horizon": 1}, definition_hash=HASH_B)
    fields = [line.split(":")[0] for line in protocol_differences(_evaluation(), candidate)]
    assert fields == ["suite definition", "tasks", "seeds", "inference"]


def test_evaluations_made_before_protocols_compare_on_their_columns():
    old, also_old = _evaluation(recorded=False), _evaluation(recorded=False)
    assert protocol_differences(old, also_old) == []
    assert protocol_differences(old, _evaluation(recorded=False, max_steps=150)) == [
        "max_steps: baseline each task's own limit, candidate 150"]
    assert protocol_differences(_evaluation(recorded=False, inference=None),
                                _evaluation(recorded=False, inference={"action_horizon": 4})) == [
        "inference: baseline whole chunk, candidate horizon 4"]
    # An unknown suite definition never equals a recorded one.
    assert protocol_differences(old, _evaluation()) == [
        "suite definition: baseline not recorded (made before provenance was), candidate aaaaaaaaaaaa"]


# ---------------------------------------------------------------------------- the store


@pytest.fixture
def session(store_engine):
    with make_session_factory(store_engine)() as session:
        yield session


def _create(session, policy, *, definition_hash: str | None, protocol: dict | None = None, standard: bool = True):
    episodes = [queries.EpisodeSpec(task=task, seed=1_000_000 + i, max_steps=500) for task in TASKS for i in range(2)]
    return queries.create_evaluation(session, policy_id=policy.id, suite="metaworld-mt10", tasks=TASKS,
                                     episodes_per_task=2, seed=0, max_steps=None, standard=standard, tags=(),
                                     episodes=episodes, protocol=protocol, definition_hash=definition_hash)


def test_the_protocol_and_definition_are_stored_with_the_evaluation(session):
    policy = add_policy(session)
    protocol = _protocol(cameras={"corner": (96, 96)})
    created = _create(session, policy, definition_hash=HASH_A, protocol=protocol)
    session.expire_all()
    stored = queries.get_evaluation(session, created.evaluation.id)
    assert stored.protocol == protocol and stored.definition_hash == HASH_A
    old = _create(session, policy, definition_hash=None)
    session.expire_all()
    assert queries.get_evaluation(session, old.evaluation.id).protocol is None  # SQL NULL, not JSON null
    assert session.scalar(select(Evaluation.id).where(Evaluation.protocol.is_(None))) == old.evaluation.id


def test_an_episode_records_its_worker_host_and_renderer(session):
    policy = add_policy(session)
    created = _create(session, policy, definition_hash=HASH_A)
    first, second = created.episode_ids[:2]
    for episode_id in (first, second):
        assert queries.claim_episode(session, episode_id, "host-1:42", 60)
    assert queries.finish_episode(session, first, success=True, steps=3, worker_host="host-1", renderer="egl",
                                  simulator_versions={"metaworld": "3.1.1"})
    assert queries.finish_episode(session, second, success=False, failure_reason="env_error")
    session.expire_all()
    one, two = (session.get(Episode, episode_id) for episode_id in (first, second))
    assert (one.worker_host, one.renderer, one.simulator_versions) == ("host-1", "egl", {"metaworld": "3.1.1"})
    assert (two.worker_host, two.renderer) == (None, None)


def test_the_leaderboard_ranks_one_definition_at_a_time(session):
    old_policy, new_policy, legacy_policy = (add_policy(session, name=n) for n in ("old", "new", "legacy"))
    old = _create(session, old_policy, definition_hash=HASH_A)
    new = _create(session, new_policy, definition_hash=HASH_B)
    legacy = _create(session, legacy_policy, definition_hash=None)
    for created, successes in ((old, 4), (new, 1), (legacy, 4)):
        run_all(session, created.episode_ids, set(created.episode_ids[:successes]))
        assert queries.finalize_evaluation_if_done(session, created.evaluation.id)

    def ranked(definition_hash):
        return [e.policy.name for e in queries.leaderboard(session, "metaworld-mt10",
                                                           definition_hash=definition_hash)]

    assert ranked(HASH_B) == ["new"]
    assert ranked(HASH_A) == ["old"]
    assert ranked(None) == ["old", "legacy", "new"]  # across every definition, older rows included
    assert queries.has_definition(session, "metaworld-mt10", HASH_A)
    assert not queries.has_definition(session, "metaworld-mt10", "c" * 64)
    assert not queries.has_definition(session, "metaworld-mt50", HASH_A)


def test_an_evaluation_made_before_revision_0009_reads_back_and_compares_on_its_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    migrate.upgrade(url, "0008")
    engine = create_db_engine(url=url)
    try:
        with engine.begin() as connection:  # what the API wrote at revision 0008
            connection.execute(text(
                "INSERT INTO policies (id, name, version, endpoint, protocol, tasks, created_at) "
                "VALUES (1, 'bc', 'v1', 'ws://x.test/ws', 'evalforge', '[]', '2026-12-01 00:00:00')"))
            connection.execute(text(
                "INSERT INTO evaluations (id, policy_id, suite, tasks, episodes_per_task, seed, standard, status, "
                "episodes_total, created_at) VALUES (1, 1, 'metaworld-mt10', '[\"reach-v3\", \"push-v3\"]', 2, 0, "
                "1, 'pending', 4, '2026-12-01 00:00:00')"))
            connection.execute(text(
                "INSERT INTO episodes (evaluation_id, episode_index, task, seed, max_steps, status, attempts, "
                "worker_id, created_at) VALUES (1, 0, 'reach-v3', 1000000, 500, 'succeeded', 1, 'w:1', "
                "'2026-12-01 00:00:00')"))
        migrate.upgrade(url)
        with make_session_factory(engine)() as session:
            old = queries.get_evaluation(session, 1)
            assert (old.protocol, old.definition_hash) == (None, None)
            assert session.get(Episode, 1).worker_host is None
            assert protocol_differences(old, _evaluation(recorded=False)) == []
            assert queries.leaderboard(session, "metaworld-mt10", definition_hash=HASH_A) == []
    finally:
        engine.dispose()


def test_the_worker_records_mujocos_gl_backend_as_the_renderer_of_mujoco_simulators(monkeypatch):
    from services.workers.runner import renderer

    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    assert renderer("metaworld") == "osmesa"
    assert renderer("gym-pusht") is None  # pygame draws PushT's frames: no OpenGL backend to name
    monkeypatch.delenv("MUJOCO_GL")
    assert renderer("metaworld") is None
