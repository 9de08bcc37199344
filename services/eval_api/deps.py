"""Dependencies every route shares: the database session, the settings, and API-key checks.

Writes always need ``Authorization: Bearer <key>``; reads need one only when
``EVALFORGE_READS_NEED_KEY`` is set. A missing key is a 401 (with
``WWW-Authenticate: Bearer``), an unknown or revoked one a 403.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from services.eval_api.errors import ApiError
from services.eval_api.metrics import ApiMetrics
from services.eval_api.settings import ApiSettings
from services.queue import EpisodeQueue
from services.store.api_keys import authenticate
from services.store.models import ApiKey

_bearer = HTTPBearer(auto_error=False, description="An API key from `evalforge apikey create`.")


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def get_metrics(request: Request) -> ApiMetrics:
    return request.app.state.metrics


def get_episode_queue(request: Request) -> EpisodeQueue:
    return request.app.state.episode_queue


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
MetricsDep = Annotated[ApiMetrics, Depends(get_metrics)]
EpisodeQueueDep = Annotated[EpisodeQueue, Depends(get_episode_queue)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require_api_key(session: SessionDep, credentials: Credentials) -> ApiKey:
    if credentials is None or not credentials.credentials:
        raise ApiError(401, "unauthorized", "this request needs an API key: send `Authorization: Bearer <key>` "
                       "(an operator creates keys with `evalforge apikey create --name NAME`)",
                       headers={"WWW-Authenticate": "Bearer"})
    key = authenticate(session, credentials.credentials)
    if key is None:
        raise ApiError(403, "forbidden", "the API key is unknown or revoked; ask an operator for a valid one "
                       "(`evalforge apikey list` shows which exist)")
    return key


def require_read_access(session: SessionDep, settings: SettingsDep, credentials: Credentials) -> ApiKey | None:
    if not settings.reads_need_key:
        return None
    return require_api_key(session, credentials)


WriteKeyDep = Annotated[ApiKey, Depends(require_api_key)]
ReadAccessDep = Annotated[ApiKey | None, Depends(require_read_access)]
