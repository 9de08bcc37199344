"""API keys: writes always need one, reads when configured; missing → 401, wrong or revoked → 403."""

from __future__ import annotations

import pytest

from services.store.api_keys import create_api_key, revoke_api_key
from tests.eval_api.conftest import make_api

WRITES = [("post", "/policies", {"name": "p", "endpoint": "ws://x.test/ws"}),
          ("post", "/evaluations", {"policy_id": 1, "suite": "metaworld-mt10", "episodes_per_task": 1}),
          ("post", "/evaluations/1/cancel", None)]
READS = ["/policies", "/policies/1", "/evaluations", "/evaluations/1", "/evaluations/1/episodes",
         "/leaderboard?suite=pusht", "/suites", "/suites/pusht"]
OPEN = ["/healthz", "/metrics", "/openapi.json", "/docs"]


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_writes_need_a_valid_key(api, method, path, body):
    response = getattr(api.client, method)(path, json=body)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "unauthorized"
    assert "evalforge apikey create" in response.json()["error"]["message"]

    for header in ({"Authorization": "Bearer efk_not-a-real-key"}, {"Authorization": "Basic dXNlcjpwYXNz"}):
        response = getattr(api.client, method)(path, json=body, headers=header)
        assert response.status_code in (401, 403)
    response = getattr(api.client, method)(path, json=body, headers={"Authorization": "Bearer efk_wrong"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"


def test_revoked_key_is_refused(api):
    with api.sessions() as session:
        row, key = create_api_key(session, "short-lived")
    headers = {"Authorization": f"Bearer {key}"}
    assert api.client.post("/evaluations/1/cancel", headers=headers).status_code == 404  # authenticated
    with api.sessions() as session:
        revoke_api_key(session, row.id)
    assert api.client.post("/evaluations/1/cancel", headers=headers).status_code == 403


def test_reads_are_open_by_default(api):
    for path in READS:
        assert api.client.get(path).status_code in (200, 404), path


@pytest.fixture
def locked_api(store_engine):
    yield from make_api(store_engine, reads_need_key=True)


def test_reads_need_a_key_when_configured(locked_api):
    for path in READS:
        assert locked_api.client.get(path).status_code == 401, path
        assert locked_api.client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 403, path
        assert locked_api.client.get(path, headers=locked_api.auth).status_code in (200, 404), path
    for path in OPEN:  # probes and scrapers never need one
        assert locked_api.client.get(path).status_code == 200, path
