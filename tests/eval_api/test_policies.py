"""``/policies`` against a real policy server (transformers engine): the handshake is read from
the server itself; endpoints that do not answer it are refused with the reason."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from policy_format import checkpoint_digest
from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.supervisor import free_port
from tests.eval_api.conftest import RecordingQueue
from tests.policy_server.conftest import (
    ACTION_DIM,
    CHUNK,
    STATE_DIM,
    TASKS,
    make_checkpoint,
    start_server,
)


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy")
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs"), "--engine", "hf")
    yield server, checkpoint
    server.stop()


@pytest.fixture
def real_api(store_engine):
    from fastapi.testclient import TestClient

    from services.store.api_keys import create_api_key
    from services.store.db import make_session_factory

    app = create_app(ApiSettings(policy_handshake_timeout_s=1.5), engine=store_engine,
                     episode_queue=RecordingQueue())
    with make_session_factory(store_engine)() as session:
        _, key = create_api_key(session, "tests")
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


@pytest.mark.slow
def test_register_reads_the_servers_handshake(real_api, policy_server):
    server, checkpoint = policy_server
    response = real_api.post("/policies", json={"name": "tiny", "endpoint": server.ws_url})
    assert response.status_code == 201, response.text
    policy = response.json()
    sha = checkpoint_digest(checkpoint)
    assert response.headers["Location"] == f"/policies/{policy['id']}"
    assert policy["checkpoint_sha256"] == sha and policy["version"] == sha[:12]
    assert (policy["state_dim"], policy["action_dim"], policy["chunk_size"]) == (STATE_DIM, ACTION_DIM, CHUNK)
    assert policy["tasks"] == list(TASKS) and policy["endpoint"] == server.ws_url

    # Same name and version, same checkpoint: the existing policy (its endpoint refreshed).
    again = real_api.post("/policies", json={"name": "tiny", "version": sha[:12], "endpoint": server.ws_url})
    assert again.status_code == 200 and again.json()["id"] == policy["id"]
    named = real_api.post("/policies", json={"name": "tiny", "version": "v2", "endpoint": server.ws_url})
    assert named.status_code == 201 and named.json()["version"] == "v2"

    assert real_api.get(f"/policies/{policy['id']}").json() == policy
    listed = real_api.get("/policies", params={"limit": 1}).json()
    assert [p["version"] for p in listed["items"]] == ["v2"] and listed["next_cursor"]
    rest = real_api.get("/policies", params={"cursor": listed["next_cursor"]}).json()
    assert [p["id"] for p in rest["items"]] == [policy["id"]] and rest["next_cursor"] is None
    assert real_api.get("/policies/999").status_code == 404

    # The registered policy can be evaluated on a suite whose tasks it knows.
    evaluation = real_api.post("/evaluations", json={"policy_id": policy["id"], "suite": "metaworld-mt10",
                                                     "tasks": ["reach-v3", "push-v3"], "episodes_per_task": 1})
    assert evaluation.status_code == 202, evaluation.text


def test_a_silent_endpoint_is_refused_with_the_reason(real_api):
    port = free_port()  # nothing listens there
    response = real_api.post("/policies", json={"name": "ghost", "endpoint": f"ws://127.0.0.1:{port}/ws"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "policy_unreachable"
    assert f"no policy server answered at ws://127.0.0.1:{port}/ws" in error["message"]
    assert "policy-server --checkpoint" in error["message"]


def test_an_endpoint_that_is_not_a_policy_server_is_refused(real_api):
    class NotWebSocket(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http = HTTPServer(("127.0.0.1", 0), NotWebSocket)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        response = real_api.post("/policies", json={"name": "web", "endpoint":
                                                    f"ws://127.0.0.1:{http.server_address[1]}/ws"})
    finally:
        http.shutdown()
    assert response.status_code == 422 and response.json()["error"]["code"] == "policy_unreachable"

    # A server that accepts and then says nothing.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        response = real_api.post("/policies", json={"name": "mute", "endpoint":
                                                    f"ws://127.0.0.1:{silent.getsockname()[1]}/ws"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "policy_unreachable"


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8000/ws", "ws://", "ws://host with space/ws", "x" * 2001])
def test_endpoint_must_be_a_websocket_url(real_api, endpoint):
    response = real_api.post("/policies", json={"name": "bad", "endpoint": endpoint})
    assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"


def test_another_checkpoint_under_a_taken_version_is_a_conflict(api):
    from tests.eval_api.conftest import metadata

    api.handshake.servers["ws://one.test/ws"] = metadata(sha="11" * 32)
    api.handshake.servers["ws://two.test/ws"] = metadata(sha="22" * 32)
    first = api.client.post("/policies", json={"name": "p", "version": "v1", "endpoint": "ws://one.test/ws"},
                            headers=api.auth)
    assert first.status_code == 201
    clash = api.client.post("/policies", json={"name": "p", "version": "v1", "endpoint": "ws://two.test/ws"},
                            headers=api.auth)
    assert clash.status_code == 409
    error = clash.json()["error"]
    assert error["code"] == "policy_version_exists" and error["details"] == {"policy_id": first.json()["id"]}
    assert "register it under another version" in error["message"]
