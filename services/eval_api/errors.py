"""Every error the API returns, as JSON of one shape: ``{"error": {"code", "message", "details"?}}``.

``code`` is stable and machine-readable (``not_found``, ``validation_error``,
``unknown_suite``…); ``message`` says what was wrong with which input and how to
fix it; ``details`` carries structured extras (the failing fields of a validation
error, the existing evaluation of an idempotency conflict). Handlers here cover
our own ``ApiError``, request validation, Starlette's HTTP errors (404 route, 405)
and, last, any unexpected exception (500, logged, with no internals in the body).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("evalforge.api")

_CODES_BY_STATUS = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    406: "not_acceptable", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
    422: "validation_error", 429: "too_many_requests", 500: "internal_error", 503: "unavailable",
}


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


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error the one JSON shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "the server failed to handle this request; the error is "
                              "in its log — retry, and report it if it persists")
