"""Fixtures of the API tests: the app on each store backend, with a recording episode queue,
a scripted policy handshake (tests that need a real policy server or Redis start them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from services.eval_api.app import create_app
from services.eval_api.handshake import HandshakeFailed
from services.eval_api.settings import ApiSettings
from services.protocol.adapters import ServerInfo
from services.protocol.messages import Metadata
from services.store.api_keys import create_api_key
from services.store.db import make_session_factory
from tests.store.databases import (  # noqa: F401  (fixtures)
    pg_database,
    pg_engine,
    sqlite_template,
    sqlite_url,
    store_engine,
)

MT10_TASKS = ("reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3", "drawer-close-v3",
              "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3")
POLICY_ENDPOINT = "ws://policy.test:8000/ws"


class RecordingQueue:
    """An ``EpisodeQueue`` that remembers what it was sent; ``down=True`` plays a dead broker."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.queues: list[str | None] = []  # the simulator family of each id sent
        self.down = False

    def enqueue(self, episode_ids: list[int], simulator: str | None = None) -> int:
        if self.down:
            return 0
        self.sent.extend(episode_ids)
        self.queues.extend([simulator] * len(episode_ids))
        return len(episode_ids)

    def ping(self) -> None:
        if self.down:
            raise ConnectionError("broker is down (test)")


@dataclass
class ScriptedHandshake:
    """Policy servers by endpoint (what each says about itself); any other endpoint does not answer.

    ``asked`` records the protocol and key map each registration read the handshake with."""

    servers: dict[str, Metadata | ServerInfo] = field(default_factory=dict)
    asked: list[tuple[str, str, dict | None]] = field(default_factory=list)

    def __call__(self, endpoint: str, timeout_s: float, protocol: str = "evalforge",
                 observation_keys: dict | None = None) -> ServerInfo:
        self.asked.append((endpoint, protocol, observation_keys))
        if endpoint not in self.servers:
            raise HandshakeFailed(f"no policy server answered at {endpoint} within {timeout_s:g}s")
        server = self.servers[endpoint]
        return ServerInfo.from_metadata(server) if isinstance(server, Metadata) else server


def metadata(tasks: tuple[str, ...] = MT10_TASKS, sha: str = "ab" * 32, state_dim: int = 39,
             action_dim: int = 4, cameras: dict[str, tuple[int, int]] | None = None) -> Metadata:
    return Metadata(policy_name="bc", checkpoint_sha256=sha, state_dim=state_dim, action_dim=action_dim,
                    chunk_size=4, tasks=tasks, cameras=cameras or {})


@dataclass
class Api:
    app: FastAPI
    client: TestClient
    key: str
    queue: RecordingQueue
    handshake: ScriptedHandshake
    sessions: sessionmaker[Session]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def register_policy(self, name: str = "bc", endpoint: str = POLICY_ENDPOINT, **meta: Any) -> dict:
        self.handshake.servers.setdefault(endpoint, metadata(**meta))
        response = self.client.post("/policies", json={"name": name, "endpoint": endpoint}, headers=self.auth)
        assert response.status_code in (200, 201), response.text
        return response.json()

    def submit(self, policy_id: int, *, expect: int = 202, headers: dict[str, str] | None = None,
               **body: Any) -> dict:
        payload = {"policy_id": policy_id, "suite": "metaworld-mt10", "episodes_per_task": 2, "seed": 0, **body}
        response = self.client.post("/evaluations", json=payload, headers={**self.auth, **(headers or {})})
        assert response.status_code == expect, response.text
        return response.json()


def make_api(engine: Engine, **settings: Any) -> Iterator[Api]:
    api_settings = ApiSettings(**{"max_episodes_per_evaluation": 2_000, **settings})
    queue, handshake = RecordingQueue(), ScriptedHandshake()
    app = create_app(api_settings, engine=engine, episode_queue=queue, handshake=handshake)
    sessions = make_session_factory(engine)
    with sessions() as session:
        _, key = create_api_key(session, "tests")
    with TestClient(app) as client:
        yield Api(app, client, key, queue, handshake, sessions)


@pytest.fixture
def api(store_engine) -> Iterator[Api]:  # noqa: F811 - the fixture imported above
    yield from make_api(store_engine)
