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
    PolicyEndpointCreate,
    PolicyOut,
    PolicySummary,
    error_responses,
)
from services.eval_api.settings import ApiSettings
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
    info = _check_registration(body, await _handshake(request, settings, body.endpoint, body.protocol, keys))
    replicas = [e for e in dict.fromkeys(body.replicas) if e != body.endpoint]
    for endpoint in replicas:
        _check_replica(body.name, info.checkpoint_sha256, info.revision, endpoint,
                       await _handshake(request, settings, endpoint, body.protocol, keys))
    policy, created = await run_in_threadpool(_store_registration, sessions, body, info, caller)
    if replicas:
        policy = await run_in_threadpool(_store_replicas, sessions, policy.id, replicas, caller)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/policies/{policy.id}"
    return policy


async def _handshake(request: Request, settings: ApiSettings, endpoint: str, protocol: str,
                     keys: dict[str, str] | None) -> ServerInfo:
    """The handshake of the server at ``endpoint``, read in one of the app's registration slots (503
    when none frees up in time), with no database session open; 422 when it does not answer."""
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
        return await anyio.to_thread.run_sync(
            request.app.state.read_handshake, endpoint, settings.policy_handshake_timeout_s, protocol,
            keys, limiter=request.app.state.handshake_threads)
    except HandshakeFailed as exc:
        fix = ("start the policy server (`policy-server --checkpoint DIR`)" if protocol == "evalforge"
               else f"start the {protocol} server, or check `protocol`")
        raise ApiError(422, "policy_unreachable", f"{exc}; {fix} or correct `endpoint`") from exc
    finally:
        slots.release()


def _served(checkpoint_sha256: str | None, revision: str | None) -> str:
    return checkpoint_sha256 or revision or "an unnamed checkpoint"


def _check_replica(name: str, checkpoint_sha256: str | None, revision: str | None, endpoint: str,
                   replica: ServerInfo) -> None:
    """409 unless the server at ``endpoint`` serves the policy's checkpoint: the same sha256 where
    either side names one, else the same revision (a server that names neither is taken at the
    registration's word, as at registration)."""
    replica_revision = replica.revision or revision
    if checkpoint_sha256 is not None or replica.checkpoint_sha256 is not None:
        same = checkpoint_sha256 == replica.checkpoint_sha256
    else:
        same = revision == replica_revision
    if not same:
        raise ApiError(409, "replica_mismatch",
                       f"the replica {endpoint} of policy {name!r} serves checkpoint "
                       f"{_served(replica.checkpoint_sha256, replica_revision)[:12]}…, not the policy's "
                       f"{_served(checkpoint_sha256, revision)[:12]}…: every replica must serve the same "
                       "checkpoint; start it from the policy's checkpoint, or register it as another version",
                       {"endpoint": endpoint})


def _store_replicas(sessions: sessionmaker[Session], policy_id: int, endpoints: list[str],
                    caller: ApiCaller) -> Policy:
    with sessions() as session:
        policy = queries.get_policy(session, policy_id)
        if policy is None:
            raise ApiError(404, "not_found", f"policy {policy_id} was deleted meanwhile; register it again")
        new = [e for e in endpoints if e not in policy.endpoints]
        if new and not caller.owns(policy.created_by_key_id):
            raise _not_owner(policy, new[0])
        for endpoint in new:
            queries.add_policy_endpoint(session, policy, endpoint, created_by_key_id=caller.key_id)
        return policy


def _owned_policy(sessions: sessionmaker[Session], policy_id: int, caller: ApiCaller, endpoint: str) -> Policy:
    with sessions() as session:
        policy = queries.get_policy(session, policy_id)
        if policy is None:
            raise ApiError(404, "not_found", f"no policy with id {policy_id}; GET /policies lists them")
        if not caller.owns(policy.created_by_key_id):
            raise _not_owner(policy, endpoint)
        return policy


@router.post("/{policy_id}/endpoints", status_code=201, response_model=PolicyOut,
             responses={200: {"model": PolicyOut, "description": "The policy already has this endpoint"},
                        **error_responses(401, 403, 404, 409, 413, 422, 503)})
async def add_policy_endpoint(policy_id: Annotated[int, Path(ge=1, le=MAX_ID)], body: PolicyEndpointCreate,
                              request: Request, response: Response, settings: SettingsDep,
                              caller: WriteKeyDep) -> Policy:
    """Add a replica: another server of the policy's checkpoint.

    The API reads the server's handshake: it must name the checkpoint sha256 (or, for servers
    without one, the revision) the policy was registered with, else 409 `replica_mismatch`.
    Workers then spread the policy's episodes over all its endpoints (the least busy first),
    and an endpoint that stops answering has its episodes retried on the others. Only the key
    that registered the policy, or an admin key, may add one (403). An endpoint the policy
    already has answers 200.
    """
    sessions: sessionmaker[Session] = request.app.state.session_factory
    policy = await run_in_threadpool(_owned_policy, sessions, policy_id, caller, body.endpoint)
    response.headers["Location"] = f"/policies/{policy.id}"
    if body.endpoint in policy.endpoints:
        response.status_code = 200
        return policy
    info = await _handshake(request, settings, body.endpoint, policy.protocol, policy.observation_keys)
    _check_replica(policy.name, policy.checkpoint_sha256, policy.revision, body.endpoint, info)
    policy = await run_in_threadpool(_store_replicas, sessions, policy.id, [body.endpoint], caller)
    return policy


@router.delete("/{policy_id}/endpoints", response_model=PolicyOut,
               responses=error_responses(401, 403, 404, 409, 422))
def remove_policy_endpoint(policy_id: Annotated[int, Path(ge=1, le=MAX_ID)],
                           endpoint: Annotated[str, Query(min_length=6, max_length=2000)], request: Request,
                           caller: WriteKeyDep) -> Policy:
    """Remove a replica (`?endpoint=ws://…`); the policy's first endpoint cannot be removed (409: move it by
    registering the policy again at another endpoint). Episodes running on it finish there."""
    sessions: sessionmaker[Session] = request.app.state.session_factory
    policy = _owned_policy(sessions, policy_id, caller, endpoint)
    if endpoint == policy.endpoint:
        raise ApiError(409, "first_endpoint", f"{endpoint} is policy {policy_id}'s first endpoint, which cannot be "
                       "removed; register the policy again at another endpoint to move it")
    with sessions() as session:
        policy = queries.get_policy(session, policy_id)
        if policy is None or not queries.remove_policy_endpoint(session, policy, endpoint):
            raise ApiError(404, "not_found", f"policy {policy_id} has no replica {endpoint}; GET /policies/"
                           f"{policy_id} lists its endpoints")
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

