"""Scopes and ownership, as an attacker with a key of their own would try them (issue 16).

Each test is an attack that worked before scopes and owners existed: re-pointing
another key's policy, cancelling another key's evaluation, replaying another key's
evaluation through its ``Idempotency-Key``, writing with a read-only key. Also: the
CLI's ``--scope``, and migration 0003 turning existing keys into admins (and saying so).
"""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import text

from services.store import migrate
from services.store.api_keys import create_api_key
from services.store.db import create_db_engine
from tests.eval_api.conftest import POLICY_ENDPOINT, metadata
from tests.eval_api.test_cli import evalforge
from tests.store.databases import create_postgres_database, drop_postgres_database

EVALUATION = {"suite": "metaworld-mt10", "episodes_per_task": 1, "seed": 0}


def new_key(api, name: str, scope: str = "submit") -> dict[str, str]:
    with api.sessions() as session:
        _, key = create_api_key(session, name, scope)
    return {"Authorization": f"Bearer {key}"}


class RecordingHandshake:
    """Wraps the app's handshake reader and remembers the endpoints it was asked to contact."""

    def __init__(self, inner):
        self.inner, self.contacted = inner, []

    def __call__(self, endpoint, timeout_s, *args, **kwargs):
        self.contacted.append(endpoint)
        return self.inner(endpoint, timeout_s, *args, **kwargs)


def test_a_read_key_cannot_write(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"])
    reader = new_key(api, "dashboard", "read")
    attempts = [("/policies", {"name": "bc", "endpoint": POLICY_ENDPOINT}),
                ("/evaluations", {"policy_id": policy["id"], **EVALUATION}),
                (f"/evaluations/{evaluation['id']}/cancel", None)]
    for path, body in attempts:
        response = api.client.post(path, json=body, headers=reader)
        assert response.status_code == 403, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "insufficient_scope"
        assert "scope read" in error["message"] and "evalforge apikey create" in error["message"]
    assert api.client.get(f"/evaluations/{evaluation['id']}").json()["status"] == "pending"
    assert [e["id"] for e in api.client.get("/evaluations").json()["items"]] == [evaluation["id"]]


def test_a_read_key_reads_where_reads_need_a_key(store_engine):
    from tests.eval_api.conftest import make_api

    for api in make_api(store_engine, reads_need_key=True):
        assert api.client.get("/evaluations", headers=new_key(api, "dashboard", "read")).status_code == 200


def test_another_key_cannot_repoint_a_policy(api):
    api.handshake.servers["ws://mine.test/ws"] = metadata()
    api.handshake.servers["ws://attacker.test/ws"] = metadata()  # a server claiming the same checkpoint
    recording = api.app.state.read_handshake = RecordingHandshake(api.handshake)
    owner = api.client.post("/policies", json={"name": "bc", "version": "v1", "endpoint": "ws://mine.test/ws"},
                            headers=api.auth)
    assert owner.status_code == 201
    policy_id = owner.json()["id"]
    attacker = new_key(api, "someone else")

    for body in ({"name": "bc", "version": "v1", "endpoint": "ws://attacker.test/ws"},
                 {"name": "bc", "endpoint": "ws://attacker.test/ws"}):  # version from the checkpoint: "abab…"
        if "version" not in body:
            api.client.post("/policies", json={"name": "bc", "endpoint": "ws://mine.test/ws"}, headers=api.auth)
        response = api.client.post("/policies", json=body, headers=attacker)
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "not_owner" and "another API key" in error["message"]
        assert "register your server under another name or version" in error["message"]
    # With an explicit version the API refuses before connecting anywhere the attacker names.
    assert recording.contacted.count("ws://attacker.test/ws") == 1
    assert api.client.get(f"/policies/{policy_id}").json()["endpoint"] == "ws://mine.test/ws"

    # Registering it again unchanged is harmless (200, nothing moves); the owner and an admin may move it.
    same = api.client.post("/policies", json={"name": "bc", "version": "v1", "endpoint": "ws://mine.test/ws"},
                           headers=attacker)
    assert same.status_code == 200 and same.json()["endpoint"] == "ws://mine.test/ws"
    api.handshake.servers["ws://moved.test/ws"] = metadata()
    moved = api.client.post("/policies", json={"name": "bc", "version": "v1", "endpoint": "ws://moved.test/ws"},
                            headers=api.auth)
    assert moved.status_code == 200 and moved.json()["endpoint"] == "ws://moved.test/ws"
    admin = new_key(api, "operator", "admin")
    rescued = api.client.post("/policies", json={"name": "bc", "version": "v1", "endpoint": "ws://mine.test/ws"},
                              headers=admin)
    assert rescued.status_code == 200 and rescued.json()["id"] == policy_id


def test_another_key_cannot_cancel_an_evaluation(api):
    policy = api.register_policy()
    victim = api.submit(policy["id"])
    attacker = new_key(api, "someone else")
    response = api.client.post(f"/evaluations/{victim['id']}/cancel", headers=attacker)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "not_owner" and "submitted by another API key" in error["message"]
    assert api.client.get(f"/evaluations/{victim['id']}").json()["status"] == "pending"

    # The attacker's own evaluation of the same policy is theirs to cancel; the owner's is the owner's.
    own = api.client.post("/evaluations", json={"policy_id": policy["id"], **EVALUATION}, headers=attacker).json()
    assert api.client.post(f"/evaluations/{own['id']}/cancel", headers=attacker).json()["status"] == "cancelled"
    assert api.client.post(f"/evaluations/{victim['id']}/cancel", headers=api.auth).json()["status"] == "cancelled"
    another = api.submit(policy["id"])
    admin = new_key(api, "operator", "admin")
    assert api.client.post(f"/evaluations/{another['id']}/cancel", headers=admin).json()["status"] == "cancelled"


def test_idempotency_keys_are_scoped_per_api_key(api):
    policy = api.register_policy()
    body = {"policy_id": policy["id"], **EVALUATION}
    first = api.client.post("/evaluations", json=body, headers={**api.auth, "Idempotency-Key": "nightly-1"})
    assert first.status_code == 202
    attacker = {**new_key(api, "someone else"), "Idempotency-Key": "nightly-1"}

    # Same key string, same body, another API key: a new evaluation, not the victim's.
    replay = api.client.post("/evaluations", json=body, headers=attacker)
    assert replay.status_code == 202 and "Idempotent-Replayed" not in replay.headers
    assert replay.json()["id"] != first.json()["id"]
    # Another body: no 409 naming the victim's evaluation either (that key string is the attacker's own now).
    other = api.client.post("/evaluations", json={**body, "seed": 7}, headers=attacker)
    assert other.status_code == 409
    assert other.json()["error"]["details"] == {"evaluation_id": replay.json()["id"]}

    # The owner's retry still replays the owner's evaluation.
    again = api.client.post("/evaluations", json=body, headers={**api.auth, "Idempotency-Key": "nightly-1"})
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]


def test_rows_from_before_owners_are_admin_only(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"])
    with api.sessions() as session:  # what migration 0003 leaves on older rows
        session.execute(text("UPDATE evaluations SET created_by_key_id = NULL"))
        session.execute(text("UPDATE policies SET created_by_key_id = NULL"))
        session.commit()
    assert api.client.post(f"/evaluations/{evaluation['id']}/cancel", headers=api.auth).status_code == 403
    api.handshake.servers["ws://elsewhere.test/ws"] = metadata()
    moved = api.client.post("/policies", json={"name": "bc", "version": policy["version"],
                                               "endpoint": "ws://elsewhere.test/ws"}, headers=api.auth)
    assert moved.status_code == 403
    admin = new_key(api, "operator", "admin")
    assert api.client.post(f"/evaluations/{evaluation['id']}/cancel", headers=admin).status_code == 200


def test_apikey_create_scopes(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    evalforge(url, "db", "upgrade")
    assert "with scope submit" in evalforge(url, "apikey", "create", "--name", "ci").stdout
    assert "with scope admin" in evalforge(url, "apikey", "create", "--name", "ops", "--scope", "admin").stdout
    assert "with scope read" in evalforge(url, "apikey", "create", "--name", "dash", "--scope", "read").stdout
    listing = evalforge(url, "apikey", "list").stdout.splitlines()
    scopes = {line.split()[-1]: line.split()[3] for line in listing[1:]}
    assert scopes == {"ci": "submit", "ops": "submit,admin", "dash": "read"}
    refused = evalforge(url, "apikey", "create", "--name", "x", "--scope", "root", check=False)
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_at_0002(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
        migrate.upgrade(url, "0002")
        yield url
        return
    base = request.getfixturevalue("postgres_url")
    url = create_postgres_database(base, prefix="evalforge_scopes")
    try:
        migrate.upgrade(url, "0002")
        yield url
    finally:
        drop_postgres_database(url, base)


def test_migration_makes_existing_keys_admins_and_says_so(database_at_0002, caplog):
    engine = create_db_engine(url=database_at_0002)
    try:
        with engine.begin() as connection:
            for name in ("old-ci", "old-laptop"):
                connection.execute(text("INSERT INTO api_keys (name, key_sha256, prefix, created_at) "
                                        "VALUES (:name, :sha, 'efk_x', CURRENT_TIMESTAMP)"),
                                   {"name": name, "sha": name.ljust(64, "0")})
        with caplog.at_level(logging.WARNING):
            migrate.upgrade(database_at_0002, "0003")
        assert "2 existing API key(s) now have scopes submit,admin" in caplog.text
        with engine.connect() as connection:
            assert set(connection.execute(text("SELECT scopes FROM api_keys")).scalars()) == {"submit,admin"}
            connection.execute(text("INSERT INTO api_keys (name, key_sha256, prefix, created_at, scopes) "
                                    "VALUES ('dash', :sha, 'efk_y', CURRENT_TIMESTAMP, 'read')"), {"sha": "f" * 64})
            connection.commit()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            migrate.downgrade(database_at_0002, "0002")
        assert "revoked 1 read-only API key(s)" in caplog.text  # it could write again without scopes
        with engine.connect() as connection:
            revoked = connection.execute(text("SELECT name FROM api_keys WHERE revoked_at IS NOT NULL")).scalars()
            assert list(revoked) == ["dash"]
    finally:
        engine.dispose()
