"""Every error the API returns, as JSON of one shape: ``{"error": {"code", "message", "details"?}}``.

``code`` is stable and machine-readable (``not_found``, ``validation_error``,
``unknown_suite``…); ``message`` says what was wrong with which input and how to
fix it; ``details`` carries structured extras (the failing fields of a validation
error, the existing evaluation of an idempotency conflict). Handlers here cover
our own ``ApiError``, request validation, Starlette's HTTP errors (404 route, 405),
a store that cannot take more right now (SQLite's "database is locked" after its
busy timeout, a PostgreSQL pool with no free connection: 503 with ``Retry-After``,
never 500), a store that cannot be reached (a PostgreSQL server restarting: refused or
dropped connections, "the database system is shutting down"; 503 ``store_unavailable``
with ``Retry-After``, answered as soon as the connection attempt fails — the pool
pre-pings, and the first request after the restart reconnects) and, last, any
unexpected exception (500, logged, with no internals in the body).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("evalforge.api")

_CODES_BY_STATUS = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    406: "not_acceptable", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
    422: "validation_error", 429: "too_many_requests", 500: "internal_error", 503: "unavailable",
}


STORE_BUSY_RETRY_AFTER_S = 2
STORE_UNAVAILABLE_RETRY_AFTER_S = 5
"""``Retry-After`` (seconds) of a 503 from a store that cannot be reached (restarting)."""
"""``Retry-After`` (seconds) of a 503 from a store that is too busy to take the request now."""
_STORE_BUSY_MESSAGES = ("database is locked", "database table is locked")


def store_busy(exc: BaseException) -> bool:
    """Whether ``exc`` says the store is busy (a retry will succeed), not that something is broken."""
    if isinstance(exc, PoolTimeout):
        return True
    return isinstance(exc, OperationalError) and any(m in str(exc.orig) for m in _STORE_BUSY_MESSAGES)


def store_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database server cannot be reached now: a connection that was refused or
    dropped (SQLAlchemy invalidated it), or any PostgreSQL operational error (psycopg's: connection
    failures, an administrator's shutdown, a server in recovery) — not a broken query, which is a bug."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OperationalError) and type(exc.orig).__module__.startswith("psycopg")


class ApiError(Exception):
    """An error response: HTTP status, stable code, a message that names the fix, optional details."""

    def __init__(self, status: int, code: str, message: str, details: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        error["details"] = details
    return {"error": error}


def error_response(status: int, code: str, message: str, details: Any = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)


def _validation_details(exc: RequestValidationError) -> list[dict[str, Any]]:
    # Only loc/msg/type: pydantic's "input" and "ctx" may hold values JSON cannot encode.
    return [{"loc": [str(part) for part in err.get("loc", ())], "msg": str(err.get("msg", "")),
             "type": str(err.get("type", ""))} for err in exc.errors()]


MISSING_KEY_MESSAGE = ("this request needs an API key: send `Authorization: Bearer <key>` (an operator creates "
                       "keys with `evalforge apikey create --name NAME`)")


def missing_key_response() -> JSONResponse:
    return error_response(401, "unauthorized", MISSING_KEY_MESSAGE, headers={"WWW-Authenticate": "Bearer"})


def _needs_key(request: Request) -> bool:
    """Writes always need a key; reads when the server sets EVALFORGE_READS_NEED_KEY (see ``deps``)."""
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        return True
    settings = getattr(request.app.state, "settings", None)
    return bool(getattr(settings, "reads_need_key", False)) and not request.url.path.startswith("/ui")


def _has_bearer(request: Request) -> bool:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(credentials.strip())


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the one JSON shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI parses the body before the key check runs: authentication first, so a request
        # without a key learns that it needs one — not what its (unauthorised) body got wrong.
        if _needs_key(request) and not _has_bearer(request):
            return missing_key_response()
        details = _validation_details(exc)
        shown = "; ".join(f"{'.'.join(d['loc']) or 'request'}: {d['msg']}" for d in details[:5])
        more = f" (and {len(details) - 5} more)" if len(details) > 5 else ""
        return error_response(422, "validation_error", f"invalid request: {shown}{more}", details)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _CODES_BY_STATUS.get(exc.status_code, f"http_{exc.status_code}")
        message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; GET /docs lists the API"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; GET /docs lists the API"
        return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))

    async def _store_error(request: Request, exc: Exception) -> JSONResponse:
        if store_unavailable(exc) and not store_busy(exc):
            log.warning("store unavailable in %s %s: %s", request.method, request.url.path,
                        str(getattr(exc, "orig", exc)).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            return error_response(503, "store_unavailable", "the results store cannot be reached right now (it may "
                                  f"be restarting); retry after {STORE_UNAVAILABLE_RETRY_AFTER_S} s (a submission "
                                  "sent with an Idempotency-Key is safe to retry: it never runs twice)",
                                  headers={"Retry-After": str(STORE_UNAVAILABLE_RETRY_AFTER_S)})
        if not store_busy(exc):
            return await _unexpected(request, exc)
        log.warning("store busy in %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, "store_busy", "the results store is busy with other writes and could not take "
                              f"this request now; retry after {STORE_BUSY_RETRY_AFTER_S} s (nothing was stored)",
                              headers={"Retry-After": str(STORE_BUSY_RETRY_AFTER_S)})

    app.add_exception_handler(DBAPIError, _store_error)
    app.add_exception_handler(OperationalError, _store_error)
    app.add_exception_handler(PoolTimeout, _store_error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "the server failed to handle this request; the error is "
                              "in its log — retry, and report it if it persists")
