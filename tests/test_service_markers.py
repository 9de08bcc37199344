"""The service-marker scheme: a test that needs PostgreSQL or Redis runs when the
service is reachable, skips with what to start when it is not, and fails instead
when EVALFORGE_REQUIRE_SERVICES=1 — checked by running pytest on a small suite."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).parent / "conftest.py"
SUITE = """
import pytest

@pytest.mark.postgres
def test_needs_postgres(postgres_url):
    assert postgres_url

@pytest.mark.redis
def test_needs_redis(redis_url):
    assert redis_url

def test_needs_nothing():
    pass
"""
UNREACHABLE = {"TEST_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
               "TEST_REDIS_URL": "redis://127.0.0.1:1/0"}


@pytest.fixture
def suite(pytester):
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    postgres: x\n    redis: x\n    vllm: x\n")
    return pytester


def test_unreachable_services_skip_with_what_to_start(suite, monkeypatch):
    for key, value in UNREACHABLE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("EVALFORGE_REQUIRE_SERVICES", raising=False)
    result = suite.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*PostgreSQL is not reachable at*set TEST_DATABASE_URL*",
                                 "*Redis is not reachable at*start `redis-server`*"])


def test_unreachable_services_fail_when_required(suite, monkeypatch):
    for key, value in UNREACHABLE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EVALFORGE_REQUIRE_SERVICES", "1")
    result = suite.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["*EVALFORGE_REQUIRE_SERVICES=1 and PostgreSQL is not reachable*"])


@pytest.mark.postgres
@pytest.mark.redis
def test_reachable_services_run(suite, monkeypatch):
    monkeypatch.delenv("TEST_DATABASE_URL", raising=False)
    monkeypatch.delenv("TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("EVALFORGE_REQUIRE_SERVICES", "1")
    suite.runpytest_subprocess().assert_outcomes(passed=3)
