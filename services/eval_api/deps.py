"""Dependencies every route shares: the database session, the settings, and API-key checks.

Writes always need ``Authorization: Bearer <key>`` with the ``submit`` (or ``admin``)
scope; reads need a key (any scope) only when ``EVALFORGE_READS_NEED_KEY`` is set. A
missing key is a 401 (with ``WWW-Authenticate: Bearer``), an unknown or revoked one a
403, and so is a ``read`` key on a write (code ``insufficient_scope``).

Sessions never outlive the route function (``scope="function"``): the session is
closed — its transaction ended, its connection back in the pool — before the
response is sent and before any background task (enqueueing to the broker) runs, so
a slow client or a slow broker never holds the database. Write-key checks open their
own short session and hand routes an ``ApiCaller`` (plain values, not an ORM row), so
a route that talks to the network first (``POST /policies``) needs no session at all
while it does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from services.eval_api.errors import ApiError
from services.eval_api.metrics import ApiMetrics
from services.eval_api.settings import ApiSettings
from services.queue import EpisodeQueue
from services.store.api_keys import authenticate
from services.store.models import ApiKey, ApiKeyScope, grants

_bearer = HTTPBearer(auto_error=False, description="An API key from `evalforge apikey create`.")


@dataclass(frozen=True, slots=True)
class ApiCaller:
    """The authenticated API key of a request, as plain values."""

    key_id: int
    name: str
    prefix: str
    scopes: frozenset[ApiKeyScope]

    @classmethod
    def of(cls, row: ApiKey) -> ApiCaller:
        return cls(key_id=row.id, name=row.name, prefix=row.prefix, scopes=row.scope_set)

    def allows(self, scope: ApiKeyScope) -> bool:
        return grants(self.scopes, scope)

    @property
    def is_admin(self) -> bool:
        return self.allows(ApiKeyScope.ADMIN)

    @property
    def owner_filter(self) -> int | None:
        """The key id a change must be owned by: None for an admin (anything goes)."""
        return None if self.is_admin else self.key_id

    def owns(self, created_by_key_id: int | None) -> bool:
        """May this key change a row created by ``created_by_key_id``? (Its own, or any for an admin.)"""
        return self.is_admin or created_by_key_id == self.key_id

    def describe(self) -> str:
        return f"API key {self.key_id} ({self.prefix}…, {self.name!r})"


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def get_metrics(request: Request) -> ApiMetrics:
    return request.app.state.metrics


def get_episode_queue(request: Request) -> EpisodeQueue:
    return request.app.state.episode_queue


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
MetricsDep = Annotated[ApiMetrics, Depends(get_metrics)]
EpisodeQueueDep = Annotated[EpisodeQueue, Depends(get_episode_queue)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def authenticate_caller(session: Session, credentials: HTTPAuthorizationCredentials | None) -> ApiCaller:
    """The caller of a request that needs a key; 401 without one, 403 for an unknown or revoked one."""
    if credentials is None or not credentials.credentials:
        raise ApiError(401, "unauthorized", "this request needs an API key: send `Authorization: Bearer <key>` "
                       "(an operator creates keys with `evalforge apikey create --name NAME`)",
                       headers={"WWW-Authenticate": "Bearer"})
    key = authenticate(session, credentials.credentials)
    if key is None:
        raise ApiError(403, "forbidden", "the API key is unknown or revoked; ask an operator for a valid one "
                       "(`evalforge apikey list` shows which exist)")
    return ApiCaller.of(key)


def require_api_key(request: Request, credentials: Credentials) -> ApiCaller:
    """Any valid key, checked in a session of its own that is closed before the route runs."""
    with request.app.state.session_factory() as session:
        return authenticate_caller(session, credentials)


def require_submit_key(caller: Annotated[ApiCaller, Depends(require_api_key)]) -> ApiCaller:
    """A key that may write: scope ``submit`` or ``admin``; a ``read`` key is a 403."""
    if not caller.allows(ApiKeyScope.SUBMIT):
        raise ApiError(403, "insufficient_scope",
                       f"{caller.describe()} has scope read, which cannot register policies or submit or cancel "
                       "evaluations; use a key with scope submit (an operator creates one with `evalforge apikey "
                       "create --name NAME`)")
    return caller


def require_read_access(session: SessionDep, settings: SettingsDep, credentials: Credentials) -> ApiCaller | None:
    if not settings.reads_need_key:
        return None
    caller = authenticate_caller(session, credentials)
    session.rollback()  # end the lookup's transaction: the route starts its own reads
    return caller


WriteKeyDep = Annotated[ApiCaller, Depends(require_submit_key)]
ReadAccessDep = Annotated[ApiCaller | None, Depends(require_read_access)]
