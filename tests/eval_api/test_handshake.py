"""``POST /policies`` as an attacker would use it (issue 16): against plain web services, redirects,
closed, silent and disallowed endpoints, with credentials in the URL or bidirectional-override
characters in names — the API's answer never carries what a peer said, and never tells ports apart
beyond what a user needs. Listings do not carry task lists."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.policy_hosts import (
    EndpointRefused,
    HostAllowList,
    PolicyHostsSettings,
    check_endpoint,
)
from services.store.api_keys import create_api_key
from services.store.db import make_session_factory
from services.supervisor import free_port
from tests.eval_api.conftest import RecordingQueue
from tests.protocol.loopback_server import LoopbackPolicyServer
from tests.protocol.test_client import SECRET, _WebService

TIMEOUT_S = 1.5


@pytest.fixture
def real_api(store_engine):
    """The API reading real handshakes (no scripted ones)."""
    app = create_app(ApiSettings(policy_handshake_timeout_s=TIMEOUT_S), engine=store_engine,
                     episode_queue=RecordingQueue())
    with make_session_factory(store_engine)() as session:
        _, key = create_api_key(session, "tests")
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


@pytest.fixture
def loopback():
    server = LoopbackPolicyServer().start()
    yield server
    server.stop()


def _register(client: TestClient, endpoint: str, name: str = "p", **body):
    return client.post("/policies", json={"name": name, "endpoint": endpoint, **body})


@pytest.mark.parametrize("status", [200, 401, 404, 500])
def test_a_web_services_reply_never_reaches_the_caller(real_api, status):
    service = _WebService(status)
    try:
        response = _register(real_api, service.url)
    finally:
        service.close()
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "policy_unreachable"
    assert SECRET not in response.text and "internal_secret" not in response.text
    assert SECRET not in str(response.headers)
    assert "nothing answered as a policy server" in response.json()["error"]["message"]


def test_a_redirect_is_not_followed(real_api, loopback):
    service = _WebService(302, {"Location": loopback.url})
    try:
        response = _register(real_api, service.url)
    finally:
        service.close()
    assert response.status_code == 422 and loopback.connections == 0
    assert loopback.url not in response.text and SECRET not in response.text


def test_closed_open_and_silent_ports_are_worded_only_as_a_user_needs(real_api):
    def message(endpoint: str) -> str:
        response = _register(real_api, endpoint)
        assert response.status_code == 422
        return response.json()["error"]["message"].replace(endpoint, "ENDPOINT")

    closed = message(f"ws://127.0.0.1:{free_port()}/ws")
    assert "the connection was refused" in closed
    service = _WebService(200)
    try:
        web = message(service.url)
    finally:
        service.close()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = message(f"ws://127.0.0.1:{silent.getsockname()[1]}/ws")
    assert web == mute and f"nothing answered as a policy server within {TIMEOUT_S:g} s" in web


@pytest.mark.parametrize("endpoint", ["ws://user:pass@127.0.0.1:8000/ws", "wss://token@policy.test/ws",
                                      "ws://:hunter2@policy.test/ws"])
def test_endpoints_with_credentials_are_refused(real_api, endpoint):
    response = _register(real_api, endpoint)
    assert response.status_code == 422 and response.json()["error"]["code"] == "validation_error"
    assert "credentials" in response.text
    assert "pass" not in response.text.replace("password", "") and "hunter2" not in response.text


def test_policy_hosts_limit_what_the_api_connects_to(real_api, loopback, monkeypatch):
    monkeypatch.setenv("EVALFORGE_POLICY_HOSTS", "10.0.0.0/8, gpu-3")
    refused = _register(real_api, loopback.url)
    assert refused.status_code == 422 and "EVALFORGE_POLICY_HOSTS" in refused.json()["error"]["message"]
    assert loopback.connections == 0  # refused before connecting

    monkeypatch.setenv("EVALFORGE_POLICY_HOSTS", "10.0.0.0/8,127.0.0.0/8")
    allowed = _register(real_api, loopback.url)
    assert allowed.status_code == 201, allowed.text
    assert loopback.connections == 1


def test_the_host_list_reads_names_networks_and_json():
    assert PolicyHostsSettings().allow_list().allows_any  # default: any host
    hosts = PolicyHostsSettings(policy_hosts="gpu-3, 10.0.0.0/8,fd00::/8").allow_list()
    assert hosts.allows("GPU-3") and hosts.allows("10.1.2.3") and hosts.allows("[fd00::1]")
    assert not hosts.allows("gpu-4") and not hosts.allows("192.168.0.1") and not hosts.allows("no-such.invalid")
    assert PolicyHostsSettings(policy_hosts='["127.0.0.1"]').allow_list().allows("127.0.0.1")
    assert HostAllowList.parse(["127.0.0.0/8"]).allows("localhost")  # a name: by what it resolves to
    with pytest.raises(ValueError, match="neither a host name nor an IP network"):
        PolicyHostsSettings(policy_hosts="10.0.0.0/33")
    with pytest.raises(EndpointRefused, match="credentials"):
        check_endpoint("ws://u:p@gpu-3/ws", hosts)
    with pytest.raises(EndpointRefused, match="not in EVALFORGE_POLICY_HOSTS"):
        check_endpoint("ws://192.168.0.1:8000/ws", hosts)
    check_endpoint("ws://10.0.0.7:8000/ws", hosts)


BIDI = ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]


@pytest.mark.parametrize("char", BIDI)
def test_bidirectional_overrides_are_refused_in_names_versions_and_tags(api, char):
    for body in ({"name": f"bc{char}gnp"}, {"name": "bc", "version": f"v1{char}"},
                 {"name": "bc", "endpoint": f"ws://policy.test/{char}ws"}):
        payload = {"endpoint": "ws://policy.test/ws", **body}
        response = api.client.post("/policies", json=payload, headers=api.auth)
        assert response.status_code == 422 and "bidirectional" in response.text, body
    policy = api.register_policy()
    response = api.client.post("/evaluations", headers=api.auth, json={
        "policy_id": policy["id"], "suite": "metaworld-mt10", "episodes_per_task": 1, "tags": [f"smoke{char}"]})
    assert response.status_code == 422


def test_listings_carry_task_counts_not_task_lists(api):
    tasks = tuple(f"task-{i:04d}-{'x' * 180}" for i in range(4096))
    policy = api.register_policy(name="wide", tasks=tasks)
    listed = api.client.get("/policies").json()["items"]
    assert [item["task_count"] for item in listed] == [4096] and "tasks" not in listed[0]
    assert len(api.client.get("/policies").content) < 2_000
    detail = api.client.get(f"/policies/{policy['id']}").json()
    assert detail["tasks"] == list(tasks) and detail["task_count"] == 4096
