"""``evalforge`` CLI: db upgrade, apikey create/list/revoke, and ``evalforge api`` serving.

Each command runs as its own process with ``DATABASE_URL`` set, as an operator would.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.store import migrate
from services.store.api_keys import authenticate
from services.store.db import create_db_engine, make_session_factory
from services.supervisor import ChildProcess, free_port

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


def _option_strings(parser: argparse.ArgumentParser, command: str = "") -> Iterator[tuple[str, str]]:
    """(command, option) for every option of ``parser`` and, depth first, of its sub-commands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                yield from _option_strings(sub, f"{command} {verb}".strip())
        for option in action.option_strings:
            yield command, option


def test_every_verb_is_a_module_and_every_command_that_logs_spells_log_level_once():
    from services.cli import VERBS, build_parser

    for module_name, _ in VERBS.values():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), module_name
        assert module_name == f"services.cli.{module_name.rsplit('.', 1)[1]}"
    options = set(_option_strings(build_parser()))
    assert not [o for o in options if o[1] in ("--loglevel", "--log_level")], "one spelling: --log-level"
    logging_commands = {command.split()[0] for command, option in options if option == "--log-level"}
    assert logging_commands == {"api", "worker", "sweeper", "up"}


def test_building_the_parser_for_a_verb_loads_only_that_verb():
    code = ("import sys; from services.cli import build_parser; build_parser({'apikey'}); "
            "print(sorted(m for m in ('services.cli.up', 'services.cli.rollout', 'services.cli.evaluations', "
            "'httpx', 'rich', 'celery', 'fastapi') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


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
    engine = create_db_engine(url=url)
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
    api = ChildProcess([sys.executable, "-m", "services.cli", "api", "--port", str(port), "--migrate",
                        "--log-level", "warning"], tmp_path / "api.log", health=f"http://127.0.0.1:{port}/healthz",
                       env=env, cwd=REPO, startup_timeout_s=60)
    with api:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()
        assert ready["checks"]["database"] == "ok" and ready["checks"]["broker"].startswith("error")
        assert httpx.get(f"http://127.0.0.1:{port}/suites", timeout=5).status_code == 200
        # uvicorn shuts down cleanly, then re-raises the signal so a supervisor sees it.
        assert api.stop(grace_s=30) in (0, -signal.SIGTERM)
