"""``/policies``: register a policy server by reading its handshake; list and read policies.

A policy belongs to the API key that registered it: only that key, or an admin key,
may point it at another endpoint. Registration never holds the database across the
network (see ``register_policy``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Annotated

import anyio
import anyio.to_thread
from fastapi import APIRouter, FastAPI, Path, Query, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from services.eval_api.deps import ApiCaller, ReadAccessDep, SessionDep, SettingsDep, WriteKeyDep
from services.eval_api.errors import ApiError
from services.eval_api.handshake import HandshakeFailed
from services.eval_api.pagination import decode_page_cursor, encode_cursor, page_limit
from services.eval_api.schemas import (
    MAX_ID,
    Page,
    PolicyCreate,
    PolicyOut,
    PolicySummary,
    error_responses,
)
from services.protocol.adapters import ServerInfo, check_observation_keys
from services.store import queries
from services.store.models import Policy

router = APIRouter(prefix="/policies", tags=["policies"])


def _check_registration(body: PolicyCreate, info: ServerInfo) -> ServerInfo:
    """What the registration stores: the server's word, completed by the request where the server is
    silent; a 422 naming both sides where they disagree, or where the API could not use it."""
    problems = []
    dims = {}
    for what in ("action_dim", "chunk_size"):
        said, given = getattr(info, what), getattr(body, what)
        if said is not None and given is not None and said != given:
            problems.append(f"the request gives {what} {given} but the server says {said}")
        dims[what] = said if said is not None else given
    for what, value in (("state_dim", info.state_dim), *dims.items()):
        if value is not None and not 1 <= value <= 1_000_000:
            problems.append(f"{what} {value} is out of range")
    if body.revision is not None and info.revision is not None and body.revision != info.revision:
        problems.append(f"the request names revision {body.revision!r} but the server serves {info.revision!r}")
    if problems:
        raise ApiError(422, "bad_handshake", f"the policy server at {body.endpoint} ({body.protocol}) does not fit "
                       f"this registration: {'; '.join(problems)}; fix the request or the server")
    return replace(info, revision=info.revision or body.revision, **dims)


def _version(body: PolicyCreate, info: ServerInfo) -> str:
    if body.version is not None:
        return body.version
    if info.checkpoint_sha256 is not None:
        return info.checkpoint_sha256[:12]
    if info.revision is not None:
        return info.revision
    raise ApiError(422, "version_required",
                   f"the {body.protocol} server at {body.endpoint} names no checkpoint sha256, so give the policy a "
                   "`version` or a `revision` (e.g. the checkpoint's step or tag)")


def _observation_keys(body: PolicyCreate) -> dict[str, str] | None:
    """The request's key map, checked before connecting anywhere (422 naming the bad field)."""
    if body.observation_keys is None:
        return None
    try:
        return check_observation_keys(body.protocol, body.observation_keys)
    except ValueError as exc:
        raise ApiError(422, "invalid_observation_keys", str(exc)) from None


def _not_owner(policy: Policy, endpoint: str) -> ApiError:
    return ApiError(403, "not_owner",
                    f"policy {policy.name!r} version {policy.version!r} (id {policy.id}) was registered by another "
                    f"API key, so this key cannot point it at {endpoint}; register your server under another "
                    "name or version, or ask an operator with an admin key "
                    "(`evalforge apikey create --scope admin`) to move it", {"policy_id": policy.id})


def _registration_slots(app: FastAPI, size: int) -> anyio.Semaphore:
    """The app's bound on handshakes in flight (made on first use, inside the event loop)."""
    slots = getattr(app.state, "registration_slots", None)
    if slots is None:
        slots = app.state.registration_slots = anyio.Semaphore(size)
        app.state.handshake_threads = anyio.CapacityLimiter(size)
    return slots


def _preflight(sessions: sessionmaker[Session], body: PolicyCreate, caller: ApiCaller) -> None:
    """Refuse, before connecting anywhere, to move a policy (explicit name and version) this key does not own."""
    if body.version is None:
        return
    with sessions() as session:
        existing = queries.find_policy(session, body.name, body.version)
    if existing is not None and existing.endpoint != body.endpoint and not caller.owns(existing.created_by_key_id):
        raise _not_owner(existing, body.endpoint)


def _same_checkpoint(policy: Policy, info: ServerInfo) -> bool:
    if policy.checkpoint_sha256 is not None or info.checkpoint_sha256 is not None:
        return policy.checkpoint_sha256 == info.checkpoint_sha256
    return policy.revision == info.revision


def _store_registration(sessions: sessionmaker[Session], body: PolicyCreate, info: ServerInfo,
                        caller: ApiCaller) -> tuple[Policy, bool]:
    """The short write transaction after the handshake: (the policy, whether it is new)."""
    version = _version(body, info)
    served = info.checkpoint_sha256 or info.revision or "an unnamed checkpoint"
    with sessions() as session:
        for _ in range(2):  # a second pass only when a concurrent registration inserted it first
            existing = queries.find_policy(session, body.name, version)
            if existing is not None:
                if not _same_checkpoint(existing, info) or existing.protocol != body.protocol:
                    held = existing.checkpoint_sha256 or existing.revision or "an unnamed checkpoint"
                    raise ApiError(409, "policy_version_exists",
                                   f"policy {body.name!r} version {version!r} is already registered (id "
                                   f"{existing.id}, {existing.protocol}) with checkpoint {held[:12]}…, but "
                                   f"{body.endpoint} ({body.protocol}) serves {served[:12]}…; register it "
                                   "under another version", {"policy_id": existing.id})
                if existing.endpoint == body.endpoint:
                    return existing, False  # nothing to change (closing the session ends the read)
                if not caller.owns(existing.created_by_key_id):
                    raise _not_owner(existing, body.endpoint)
                return queries.update_policy_endpoint(session, existing, body.endpoint), False
            try:
                return queries.create_policy(
                    session, name=body.name, version=version, endpoint=body.endpoint, protocol=body.protocol,
                    checkpoint_sha256=info.checkpoint_sha256, revision=info.revision, state_dim=info.state_dim,
                    action_dim=info.action_dim, chunk_size=info.chunk_size, tasks=info.tasks, cameras=info.cameras,
                    observation_keys=body.observation_keys,
                    server_info=None if body.protocol == "evalforge" else info.raw,  # ours: all in the columns
                    created_by_key_id=caller.key_id), True
            except queries.Conflict as exc:
                conflict = exc
        raise ApiError(409, "policy_version_exists", f"{conflict}; register it under another version")


@router.post("", status_code=201, response_model=PolicyOut,
             responses={200: {"model": PolicyOut, "description": "Already registered (same checkpoint)"},
                        **error_responses(401, 403, 409, 413, 422, 503)})
async def register_policy(body: PolicyCreate, request: Request, response: Response, settings: SettingsDep,
                          caller: WriteKeyDep) -> Policy:
    """Connect to the policy server at `endpoint`, read its handshake and register what it serves.

    The checkpoint sha256, dimensions, chunk size, tasks and cameras come from the
    server, not the request. `protocol` says what the server speaks: ours (`evalforge`),
    openpi's or vla-eval's. For the latter two, `observation_keys` says where the server reads
    each canonical field, and `action_dim`, `chunk_size` and `revision` fill in what the server
    does not say (a value the server does say must agree, or 422). Registering the same name and version again with the same checkpoint
    returns the existing policy (200); with another endpoint, that moves it — only the
    API key that registered it, or an admin key, may (403 otherwise). Another checkpoint
    under a taken version is a 409. A server that does not answer the handshake is a 422
    with the reason.

    No database session is open during the handshake: a short read first (may this key
    move the policy it names?), then the handshake, then a short write transaction.
    At most `EVALFORGE_MAX_CONCURRENT_REGISTRATIONS` handshakes run at once; a request
    waits up to `EVALFORGE_REGISTRATION_WAIT_S` for a slot, then gets a 503 with
    `Retry-After`.
    """
    sessions: sessionmaker[Session] = request.app.state.session_factory
    keys = _observation_keys(body)
    await run_in_threadpool(_preflight, sessions, body, caller)
    slots = _registration_slots(request.app, settings.max_concurrent_registrations)
    try:
        with anyio.fail_after(settings.registration_wait_s):
            await slots.acquire()
    except TimeoutError:
        retry_after = max(1, math.ceil(settings.policy_handshake_timeout_s))
        raise ApiError(503, "registrations_busy",
                       f"{settings.max_concurrent_registrations} policy registrations are already reading "
                       f"handshakes and none finished within {settings.registration_wait_s:g} s; retry after "
                       f"{retry_after} s (nothing was stored)", headers={"Retry-After": str(retry_after)}) from None
    try:
        # In a thread of its own limiter, so waiting handshakes never take the threads reads run on.
        info: ServerInfo = await anyio.to_thread.run_sync(
            request.app.state.read_handshake, body.endpoint, settings.policy_handshake_timeout_s, body.protocol,
            keys, limiter=request.app.state.handshake_threads)
    except HandshakeFailed as exc:
        fix = ("start the policy server (`policy-server --checkpoint DIR`)" if body.protocol == "evalforge"
               else f"start the {body.protocol} server, or check `protocol`")
        raise ApiError(422, "policy_unreachable", f"{exc}; {fix} or correct `endpoint`") from exc
    finally:
        slots.release()
    info = _check_registration(body, info)
    policy, created = await run_in_threadpool(_store_registration, sessions, body, info, caller)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/policies/{policy.id}"
    return policy


@router.get("", response_model=Page[PolicySummary], responses=error_responses(401, 403, 422))
def list_policies(session: SessionDep, settings: SettingsDep, _read: ReadAccessDep,
                  cursor: Annotated[str | None, Query(max_length=200)] = None,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 50) -> Page[PolicySummary]:
    """Registered policies, newest first."""
    limit = page_limit(limit, settings.max_page_size)
    before = decode_page_cursor(cursor, "policy")
    rows = queries.list_policies(session, before_id=before, limit=limit + 1)
    items = [PolicySummary.model_validate(row) for row in rows[:limit]]
    return Page(items=items, next_cursor=encode_cursor("policy", items[-1].id) if len(rows) > limit else None)


@router.get("/{policy_id}", response_model=PolicyOut, responses=error_responses(401, 403, 404, 422))
def get_policy(policy_id: Annotated[int, Path(ge=1, le=MAX_ID)], session: SessionDep,
               _read: ReadAccessDep) -> Policy:
    """One policy."""
    policy = queries.get_policy(session, policy_id)
    if policy is None:
        raise ApiError(404, "not_found", f"no policy with id {policy_id}; GET /policies lists them")
    return policy

