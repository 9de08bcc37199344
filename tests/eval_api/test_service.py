"""Service plumbing: health and readiness, metrics, the error shape, the body cap, the OpenAPI docs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.queue import QueueSettings
from services.store.db import create_db_engine
from tests.eval_api.conftest import RecordingQueue


def test_healthz_and_readyz(api):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    ready = api.client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready",
                                                         "checks": {"database": "ok", "broker": "ok"}}
    api.queue.down = True
    ready = api.client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["database"] == "ok" and "broker is down" in ready.json()["checks"]["broker"]


def test_readyz_fails_without_the_schema(tmp_path):
    engine = create_db_engine(url=f"sqlite:///{tmp_path / 'empty.db'}")
    app = create_app(ApiSettings(), engine=engine, episode_queue=RecordingQueue())
    with TestClient(app) as client:
        ready = client.get("/readyz")
    engine.dispose()
    assert ready.status_code == 503 and ready.json()["checks"]["database"].startswith("error: OperationalError")


def test_readyz_with_the_real_producer_and_no_broker(store_engine):
    # Nothing listens on port 1: the real Celery producer must fail fast, not hang.
    app = create_app(ApiSettings(), engine=store_engine,
                     queue_settings=QueueSettings(redis_url="redis://127.0.0.1:1/0", broker_timeout_s=0.5))
    with TestClient(app) as client:
        ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["broker"].startswith("error:")


def test_metrics_count_requests_by_route_template(api):
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=3)
    api.client.get(f"/evaluations/{evaluation['id']}")
    api.client.get("/evaluations/999999")
    text = api.client.get("/metrics").text
    assert 'evalforge_api_requests_total{method="GET",route="/evaluations/{evaluation_id}",status="200"} 1.0' in text
    assert 'evalforge_api_requests_total{method="GET",route="/evaluations/{evaluation_id}",status="404"} 1.0' in text
    assert 'evalforge_api_requests_total{method="POST",route="/evaluations",status="202"} 1.0' in text
    assert "evalforge_api_evaluations_created_total 1.0" in text
    assert "evalforge_api_episodes_enqueued_total 3.0" in text
    assert "evalforge_api_request_duration_seconds_bucket" in text


def test_broker_down_keeps_the_evaluation_for_the_sweeper(api):
    api.queue.down = True
    policy = api.register_policy()
    evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=2)
    assert api.client.get(f"/evaluations/{evaluation['id']}").json()["counts"]["pending"] == 2
    assert "evalforge_api_episodes_enqueue_failed_total 2.0" in api.client.get("/metrics").text


def test_errors_have_one_json_shape(api):
    for method, path, status, code in (("get", "/nowhere", 404, "not_found"),
                                       ("delete", "/evaluations", 405, "method_not_allowed"),
                                       ("get", "/policies/77", 404, "not_found"),
                                       ("get", "/suites/metaworld-mt11", 404, "not_found")):
        response = getattr(api.client, method)(path)
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["code"] == code and error["message"], error
    bad_json = api.client.post("/evaluations", content=b"{not json", headers={**api.auth,
                                                                              "Content-Type": "application/json"})
    assert bad_json.status_code == 422 and bad_json.json()["error"]["code"] == "validation_error"


def test_request_body_cap(api):
    too_big = b'{"name": "' + b"x" * 70_000 + b'"}'
    response = api.client.post("/policies", content=too_big, headers={**api.auth,
                                                                      "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"x" * 8192

    response = api.client.post("/policies", content=chunked(), headers={**api.auth,
                                                                        "Content-Type": "application/json"})
    assert response.status_code == 413 and "EVALFORGE_MAX_BODY_BYTES" in response.json()["error"]["message"]


def test_openapi_and_docs(api):
    schema = api.client.get("/openapi.json").json()
    assert {"/policies", "/evaluations", "/evaluations/{evaluation_id}", "/evaluations/{evaluation_id}/episodes",
            "/evaluations/{evaluation_id}/cancel", "/leaderboard", "/suites", "/healthz", "/readyz",
            "/metrics"} <= set(schema["paths"])
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert "swagger-ui" in api.client.get("/docs").text.lower()


@pytest.mark.parametrize("path", ["/suites", "/suites/metaworld-mt10"])
def test_suites_come_from_the_catalogue(api, path):
    body = api.client.get(path).json()
    suites = {s["name"]: s for s in (body if isinstance(body, list) else [body])}
    mt10 = suites["metaworld-mt10"]
    assert (mt10["state_dim"], mt10["action_dim"], len(mt10["tasks"])) == (39, 4, 10)
    assert mt10["tasks"][0] == {"name": "reach-v3", "instruction": mt10["tasks"][0]["instruction"], "max_steps": 500}
    if path == "/suites":
        from benchmarks.registry import catalogue

        assert "pusht" in suites and len(suites) == len(catalogue())
