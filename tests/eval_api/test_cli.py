"""``evalforge`` CLI: db upgrade, apikey create/list/revoke, and ``evalforge api`` serving.

Each command runs as its own process with ``DATABASE_URL`` set, as an operator would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from services.protocol.launcher import free_port
from services.store import migrate
from services.store.api_keys import authenticate
from services.store.db import make_engine, make_session_factory

REPO = Path(__file__).resolve().parents[2]


def evalforge(database_url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATABASE_URL": database_url}
    result = subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_console_script_is_registered():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["evalforge"] == "services.cli:main"
    assert {"policy-server", "trainer"} <= set(scripts)


def test_db_and_apikey_commands(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    refused = evalforge(url, "apikey", "list", check=False)
    assert refused.returncode == 2 and "evalforge db upgrade" in refused.stderr

    head = migrate.head_revision()
    assert f"is at migration {head}; newest is {head}" in evalforge(url, "db", "upgrade").stdout
    assert f"is at migration {head}" in evalforge(url, "db", "current").stdout
    assert f"is at migration {head}" not in evalforge(url, "db", "downgrade", "-1").stdout
    assert f"is at migration {head}" in evalforge(url, "db", "upgrade").stdout

    created = evalforge(url, "apikey", "create", "--name", "ci runner").stdout
    key = created.split()[-1]  # the key is the last word of the output
    assert key.startswith("efk_") and "shown only this once" in created
    engine = make_engine(url=url)
    try:
        with make_session_factory(engine)() as session:
            assert authenticate(session, key).name == "ci runner"
        listing = evalforge(url, "apikey", "list").stdout
        assert key[:12] in listing and "active" in listing and "ci runner" in listing and key not in listing
        assert "revoked API key 1" in evalforge(url, "apikey", "revoke", "1").stdout
        assert "revoked" in evalforge(url, "apikey", "list").stdout
        with make_session_factory(engine)() as session:
            assert authenticate(session, key) is None
    finally:
        engine.dispose()
    missing = evalforge(url, "apikey", "revoke", "99", check=False)
    assert missing.returncode == 1 and "no API key with id 99" in missing.stderr
    assert "(empty)" in evalforge(url, "db", "downgrade", "base").stdout


@pytest.mark.slow
def test_api_command_serves_and_refuses_an_unmigrated_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    refused = evalforge(url, "api", "--port", str(free_port()), check=False)
    assert refused.returncode == 2 and "--migrate" in refused.stderr

    port = free_port()
    env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--migrate",
                             "--log-level", "warning"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "evalforge api did not start within 60 s"
                time.sleep(0.2)
        assert response.json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()
        assert ready["checks"]["database"] == "ok" and ready["checks"]["broker"].startswith("error")
        assert httpx.get(f"http://127.0.0.1:{port}/suites", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down cleanly, then re-raises the signal so a supervisor sees it.
        assert proc.wait(30) in (0, -signal.SIGTERM)
