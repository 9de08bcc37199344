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
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.store.models import ApiKey, ApiKeyScope, utcnow
from services.store.queries import NotFound

KEY_PREFIX = "efk_"
KEY_CHARS = 43  # secrets.token_urlsafe(32)
DISPLAY_CHARS = 12


def is_well_formed(key: str) -> bool:
    body = key.removeprefix(KEY_PREFIX)
    return (key.startswith(KEY_PREFIX) and len(body) == KEY_CHARS
            and all(c.isascii() and (c.isalnum() or c in "-_") for c in body))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


# What each scope is stored as: an admin key can also submit (and read).
STORED_SCOPES = {ApiKeyScope.READ: "read", ApiKeyScope.SUBMIT: "submit", ApiKeyScope.ADMIN: "submit,admin"}


def create_api_key(session: Session, name: str,
                   scope: ApiKeyScope | str = ApiKeyScope.SUBMIT, *, plaintext: str | None = None,
                   ) -> tuple[ApiKey, str]:
    """A new key named ``name`` with ``scope``: the stored row and the plaintext (which is not kept anywhere).
    ``plaintext`` registers a key made elsewhere (a deployment's secret) instead of a random one; it
    must have the form of ours (``efk_`` and 43 URL-safe characters), so that it is as hard to guess."""
    if plaintext is not None and not is_well_formed(plaintext):
        raise ValueError(f"API key {plaintext[:DISPLAY_CHARS]!r}… is not of the form {KEY_PREFIX} followed by "
                         f"{KEY_CHARS} URL-safe characters; make one with `python -c \"import secrets; "
                         f"print('{KEY_PREFIX}' + secrets.token_urlsafe(32))\"`")
    if not name.strip():
        raise ValueError("an API key needs a non-empty name (who or what uses it)")
    try:
        scope = ApiKeyScope(scope)
    except ValueError:
        raise ValueError(f"API key scope {scope!r} is not one of "
                         f"{', '.join(s.value for s in ApiKeyScope)}") from None
    plaintext = plaintext or KEY_PREFIX + secrets.token_urlsafe(32)
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


def ensure_api_key(session: Session, key_file: Path, name: str, key: str | None = None) -> str:
    """A deployment's write key, made once: ``key`` (its secret, e.g. ``$EVALFORGE_API_KEY``), registered
    if the store does not know it yet; else the key in ``key_file`` if the store still accepts it; else a
    new one, written to ``key_file`` (mode 0600). ``evalforge up`` and compose's ``migrate`` call this."""
    if key:
        row = session.scalar(select(ApiKey).where(ApiKey.key_sha256 == hash_key(key)))
        if row is not None and row.revoked_at is not None:
            raise ValueError(f"the API key {key[:DISPLAY_CHARS]}… given is revoked; give another one")
        if row is None:
            create_api_key(session, name, plaintext=key)
        return key
    if key_file.is_file():
        known = key_file.read_text().strip()
        if known and authenticate(session, known) is not None:
            return known
    _, known = create_api_key(session, name)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.touch(mode=0o600)
    key_file.write_text(known + "\n")
    return known
