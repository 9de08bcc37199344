"""API keys: create (the plaintext is shown once), list, revoke, authenticate.

A key is ``efk_`` followed by 43 URL-safe characters (256 random bits). The store
keeps its SHA-256 and its first 12 characters (to recognise it in listings), never
the key itself. Authentication is one indexed lookup by hash.

Every key has one scope (``ApiKeyScope``): ``read``, ``submit`` (the default:
register policies, submit evaluations, change and cancel its own) or ``admin``
(everything), stored as ``read``, ``submit`` or ``submit,admin``.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.store.models import ApiKey, ApiKeyScope, utcnow
from services.store.queries import NotFound

KEY_PREFIX = "efk_"
DISPLAY_CHARS = 12


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


# What each scope is stored as: an admin key can also submit (and read).
STORED_SCOPES = {ApiKeyScope.READ: "read", ApiKeyScope.SUBMIT: "submit", ApiKeyScope.ADMIN: "submit,admin"}


def create_api_key(session: Session, name: str,
                   scope: ApiKeyScope | str = ApiKeyScope.SUBMIT) -> tuple[ApiKey, str]:
    """A new key named ``name`` with ``scope``: the stored row and the plaintext (which is not kept anywhere)."""
    if not name.strip():
        raise ValueError("an API key needs a non-empty name (who or what uses it)")
    try:
        scope = ApiKeyScope(scope)
    except ValueError:
        raise ValueError(f"API key scope {scope!r} is not one of "
                         f"{', '.join(s.value for s in ApiKeyScope)}") from None
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(name=name, key_sha256=hash_key(plaintext), prefix=plaintext[:DISPLAY_CHARS],
                 scopes=STORED_SCOPES[scope])
    session.add(row)
    session.commit()
    return row, plaintext


def list_api_keys(session: Session, *, include_revoked: bool = True) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke_api_key(session: Session, key_id: int) -> ApiKey:
    """Revoke key ``key_id`` (idempotent); ``NotFound`` if there is no such key."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFound(f"no API key with id {key_id} (`evalforge apikey list` shows them)")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return row


def authenticate(session: Session, key: str) -> ApiKey | None:
    """The live key row for ``key``; None when unknown or revoked."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_sha256 == hash_key(key)))
    return row if row is not None and row.revoked_at is None else None
