"""``/healthz`` echoes the supervisor's EVALFORGE_INSTANCE_TOKEN, so its health check knows it reached
its own child (services/supervisor.py); without one the answer is as before."""

from __future__ import annotations


def test_healthz_echoes_the_instance_token(api, monkeypatch):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    monkeypatch.setenv("EVALFORGE_INSTANCE_TOKEN", "f00d" * 8)
    assert api.client.get("/healthz").json() == {"status": "ok", "instance": "f00d" * 8}
