"""Property-based check of the whole API against its own OpenAPI schema (schemathesis):
whatever schema-shaped or malformed input arrives, no response is a 5xx, on either backend.

Bounded for speed: a fixed number of examples per operation, derandomised so a run is
reproducible. Writes carry a valid API key so they get past authentication into
validation and the store; ids 1 exist so reads reach real rows.

The schema is loaded at collection (it does not depend on the database) through a
forwarding ASGI app; each test points the forwarder at its own app and database.
(``schemathesis.pytest.from_fixture`` would avoid the forwarder but does not work with
pytest 9 in schemathesis 4.32.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from starlette.types import ASGIApp, Receive, Scope, Send

from services.eval_api.app import create_app
from services.eval_api.settings import ApiSettings
from services.store.db import create_db_engine
from tests.eval_api.conftest import RecordingQueue, make_api

EXAMPLES_PER_OPERATION = 30


class ForwardingApp:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


target = ForwardingApp(create_app(ApiSettings(), engine=create_db_engine(url="sqlite://"), episode_queue=RecordingQueue()))
schema = schemathesis.openapi.from_asgi("/openapi.json", target)


@pytest.fixture
def fuzzed_api(store_engine):
    for api in make_api(store_engine, policy_handshake_timeout_s=0.2):
        policy = api.register_policy()
        evaluation = api.submit(policy["id"], tasks=["reach-v3"], episodes_per_task=2)
        assert (policy["id"], evaluation["id"]) == (1, 1)
        target.app = api.app
        yield api


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzzed_api):
    case.call_and_validate(headers=fuzzed_api.auth, checks=[not_a_server_error])
