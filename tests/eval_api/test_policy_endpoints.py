"""Policy replicas in the API: ``POST /policies/{id}/endpoints``, a ``replicas`` list at
registration, ``GET /policies/{id}``'s ``endpoints``; every replica must answer the policy's
handshake (the same checkpoint), else 409, on SQLite and PostgreSQL."""

from __future__ import annotations

from services.protocol.adapters import ServerInfo
from tests.eval_api.conftest import POLICY_ENDPOINT, metadata
from tests.eval_api.test_client_cli import env, evalforge, evalforge_json, served  # noqa: F401  (fixtures)
from tests.eval_api.test_ownership import new_key

REPLICA = "ws://policy-2.test:8000/ws"
OTHER = "ws://policy-3.test:8000/ws"


def test_add_endpoint_with_the_same_checkpoint(api):
    policy = api.register_policy()
    assert policy["endpoints"] == [POLICY_ENDPOINT]
    api.handshake.servers[REPLICA] = metadata()
    response = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA}, headers=api.auth)
    assert response.status_code == 201, response.text
    assert response.json()["endpoints"] == [POLICY_ENDPOINT, REPLICA]
    assert api.client.get(f"/policies/{policy['id']}").json()["endpoints"] == [POLICY_ENDPOINT, REPLICA]
    again = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA}, headers=api.auth)
    assert again.status_code == 200 and again.json()["endpoints"] == [POLICY_ENDPOINT, REPLICA]
    # the first endpoint is one of its endpoints already
    first = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": POLICY_ENDPOINT},
                            headers=api.auth)
    assert first.status_code == 200 and first.json()["endpoints"] == [POLICY_ENDPOINT, REPLICA]


def test_a_replica_of_another_checkpoint_is_a_409(api):
    policy = api.register_policy()
    api.handshake.servers[REPLICA] = metadata(sha="cd" * 32)
    response = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA}, headers=api.auth)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "replica_mismatch" and "cdcdcdcdcdcd" in error["message"]
    assert "abababababab" in error["message"] and error["details"] == {"endpoint": REPLICA}
    assert api.client.get(f"/policies/{policy['id']}").json()["endpoints"] == [POLICY_ENDPOINT]


def test_a_replica_that_does_not_answer_is_a_422(api):
    policy = api.register_policy()
    response = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": OTHER}, headers=api.auth)
    assert response.status_code == 422 and response.json()["error"]["code"] == "policy_unreachable"
    missing = api.client.post("/policies/999/endpoints", json={"endpoint": OTHER}, headers=api.auth)
    assert missing.status_code == 404


def test_only_the_owner_adds_or_removes_replicas(api):
    policy = api.register_policy()
    api.handshake.servers[REPLICA] = metadata()
    stranger = new_key(api, "stranger")
    response = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA}, headers=stranger)
    assert response.status_code == 403 and response.json()["error"]["code"] == "not_owner"
    assert (REPLICA, "evalforge", None) not in api.handshake.asked, "refused before connecting"
    unauthenticated = api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA})
    assert unauthenticated.status_code == 401
    assert api.client.post(f"/policies/{policy['id']}/endpoints", json={"endpoint": REPLICA},
                           headers=api.auth).status_code == 201
    gone = api.client.delete(f"/policies/{policy['id']}/endpoints", params={"endpoint": REPLICA}, headers=stranger)
    assert gone.status_code == 403
    gone = api.client.delete(f"/policies/{policy['id']}/endpoints", params={"endpoint": REPLICA}, headers=api.auth)
    assert gone.status_code == 200 and gone.json()["endpoints"] == [POLICY_ENDPOINT]
    first = api.client.delete(f"/policies/{policy['id']}/endpoints", params={"endpoint": POLICY_ENDPOINT},
                              headers=api.auth)
    assert first.status_code == 409 and first.json()["error"]["code"] == "first_endpoint"
    again = api.client.delete(f"/policies/{policy['id']}/endpoints", params={"endpoint": REPLICA}, headers=api.auth)
    assert again.status_code == 404


def test_replicas_at_registration(api):
    api.handshake.servers[POLICY_ENDPOINT] = metadata()
    api.handshake.servers[REPLICA] = metadata()
    body = {"name": "bc", "endpoint": POLICY_ENDPOINT, "replicas": [REPLICA, REPLICA, POLICY_ENDPOINT]}
    response = api.client.post("/policies", json=body, headers=api.auth)
    assert response.status_code == 201, response.text
    assert response.json()["endpoints"] == [POLICY_ENDPOINT, REPLICA]
    # registering again with one more replica adds it (same checkpoint, same owner)
    api.handshake.servers[OTHER] = metadata()
    response = api.client.post("/policies", json={**body, "replicas": [OTHER]}, headers=api.auth)
    assert response.status_code == 200, response.text
    assert response.json()["endpoints"] == [POLICY_ENDPOINT, REPLICA, OTHER]


def test_a_mismatched_replica_at_registration_stores_nothing(api):
    api.handshake.servers[POLICY_ENDPOINT] = metadata()
    api.handshake.servers[REPLICA] = metadata(sha="cd" * 32)
    response = api.client.post("/policies", json={"name": "bc", "endpoint": POLICY_ENDPOINT, "replicas": [REPLICA]},
                               headers=api.auth)
    assert response.status_code == 409 and response.json()["error"]["code"] == "replica_mismatch"
    assert api.client.get("/policies").json()["items"] == []


def test_revision_named_replicas_of_a_remote_protocol(api):
    """Servers without a sha256 (openpi) are replicas when they name the same revision."""
    def openpi(revision):
        return ServerInfo(protocol="openpi", policy_name=None, checkpoint_sha256=None, revision=revision,
                          state_dim=None, action_dim=None, chunk_size=None)

    api.handshake.servers[POLICY_ENDPOINT] = openpi("pi05-v1")
    api.handshake.servers[REPLICA] = openpi("pi05-v1")
    api.handshake.servers[OTHER] = openpi("pi05-v2")
    response = api.client.post("/policies", json={"name": "pi", "endpoint": POLICY_ENDPOINT, "protocol": "openpi",
                                                  "action_dim": 4}, headers=api.auth)
    assert response.status_code == 201, response.text
    policy_id = response.json()["id"]
    assert api.client.post(f"/policies/{policy_id}/endpoints", json={"endpoint": REPLICA},
                           headers=api.auth).status_code == 201
    response = api.client.post(f"/policies/{policy_id}/endpoints", json={"endpoint": OTHER}, headers=api.auth)
    assert response.status_code == 409 and response.json()["error"]["code"] == "replica_mismatch"


def test_cli_adds_lists_and_removes_replicas(env, capsys):  # noqa: F811
    """`evalforge policy register --replica`, `policy add-endpoint`, `policy remove-endpoint` on a served API."""
    env.api.handshake.servers[REPLICA] = metadata()
    env.api.handshake.servers[OTHER] = metadata()
    code, out, err = evalforge(capsys, "policy", "register", "--name", "bc", "--endpoint", POLICY_ENDPOINT,
                               "--version", "v1", "--replica", REPLICA)
    assert code == 0, err
    assert "(+1 replicas)" in out
    code, out, err = evalforge(capsys, "policy", "add-endpoint", "bc:v1", OTHER)
    assert code == 0, err
    assert out.splitlines()[1:] == [f"  {POLICY_ENDPOINT}", f"  {REPLICA}", f"  {OTHER}"]
    removed = evalforge_json(capsys, "policy", "remove-endpoint", "1", REPLICA)
    assert removed["endpoints"] == [POLICY_ENDPOINT, OTHER]
    env.api.handshake.servers["ws://stranger.test:1/ws"] = metadata(sha="cd" * 32)
    code, _, err = evalforge(capsys, "policy", "add-endpoint", "bc", "ws://stranger.test:1/ws")
    assert code != 0 and "same checkpoint" in err, err
