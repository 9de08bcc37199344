"""Keyset pagination for listings: opaque cursors and the page-size cap.

A cursor encodes the last key of the previous page (base64url of ``kind:key``), so
pages stay stable while new rows arrive and cost the same at any depth.
"""

from __future__ import annotations

import base64
import binascii

from services.eval_api.errors import ApiError
from services.eval_api.schemas import MAX_ID


class InvalidCursor(ValueError):
    """A ``cursor`` that this API did not hand out."""


def encode_cursor(kind: str, position: int) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{position}".encode()).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str) -> int:
    """The position in ``cursor``; ``InvalidCursor`` if it is not a ``kind`` cursor from this API."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        found, _, position = raw.partition(":")
        value = int(position)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidCursor(f"cursor {cursor!r} is not one this API handed out") from exc
    if found != kind or not 0 <= value <= MAX_ID:
        raise InvalidCursor(f"cursor {cursor!r} is not a {kind} cursor from this API")
    return value


def page_limit(limit: int, maximum: int) -> int:
    """``limit``, or a 422 when it is over the server's maximum page size."""
    if limit > maximum:
        raise ApiError(422, "validation_error", f"limit {limit} is over this server's maximum page size "
                       f"{maximum}; ask for fewer and follow next_cursor")
    return limit


def decode_page_cursor(cursor: str | None, kind: str) -> int | None:
    """The key a ``kind`` cursor continues after (None for the first page); 422 for a foreign cursor."""
    if cursor is None:
        return None
    try:
        return decode_cursor(kind, cursor)
    except InvalidCursor as exc:
        raise ApiError(422, "invalid_cursor", f"{exc}; pass the next_cursor of a previous page, or omit it "
                       "for the first page") from exc
