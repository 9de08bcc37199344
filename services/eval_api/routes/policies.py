"""``/policies``: register a policy server by reading its handshake; list and read policies."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from services.eval_api.deps import ReadAccessDep, SessionDep, SettingsDep, WriteKeyDep
from services.eval_api.errors import ApiError
from services.eval_api.handshake import HandshakeFailed
from services.eval_api.pagination import decode_page_cursor, encode_cursor, page_limit
from services.eval_api.schemas import MAX_ID, Page, PolicyCreate, PolicyOut, error_responses
from services.protocol.messages import Metadata
from services.store import queries
from services.store.models import Policy

router = APIRouter(prefix="/policies", tags=["policies"])


def _check_metadata(endpoint: str, meta: Metadata) -> None:
    """Refuse a handshake whose facts the store could not hold or the API could not use."""
    problems = []
    if not 1 <= len(meta.checkpoint_sha256) <= 64:
        problems.append(f"checkpoint_sha256 {meta.checkpoint_sha256[:80]!r} is not a sha256 hex digest")
    for what, value in (("state_dim", meta.state_dim), ("action_dim", meta.action_dim),
                        ("chunk_size", meta.chunk_size)):
        if not 1 <= value <= 1_000_000:
            problems.append(f"{what} {value} is out of range")
    if not meta.tasks or any(not t or len(t) > 200 or "\x00" in t for t in meta.tasks):
        problems.append("tasks must be a non-empty list of task names of at most 200 characters")
    if problems:
        raise ApiError(422, "bad_handshake", f"the policy server at {endpoint} sent a handshake the API cannot "
                       f"use: {'; '.join(problems)}; fix the checkpoint's policy.json or the server")


@router.post("", status_code=201, response_model=PolicyOut,
             responses={200: {"model": PolicyOut, "description": "Already registered (same checkpoint)"},
                        **error_responses(401, 403, 409, 413, 422)})
def register_policy(body: PolicyCreate, request: Request, response: Response, session: SessionDep,
                    settings: SettingsDep, _key: WriteKeyDep) -> Policy:
    """Connect to the policy server at `endpoint`, read its handshake and register what it serves.

    The checkpoint sha256, dimensions, chunk size and tasks come from the server, not
    the request. Registering the same name and version again with the same checkpoint
    returns the existing policy (200), updating its endpoint; with another checkpoint
    it is a 409. A server that does not answer the handshake is a 422 with the reason.
    """
    try:
        meta: Metadata = request.app.state.read_handshake(body.endpoint, settings.policy_handshake_timeout_s)
    except HandshakeFailed as exc:
        raise ApiError(422, "policy_unreachable", f"{exc}; start the policy server (`policy-server "
                       "--checkpoint DIR`) or correct `endpoint`") from exc
    _check_metadata(body.endpoint, meta)
    version = body.version or meta.checkpoint_sha256[:12]
    existing = queries.find_policy(session, body.name, version)
    if existing is not None:
        if existing.checkpoint_sha256 != meta.checkpoint_sha256:
            raise ApiError(409, "policy_version_exists",
                           f"policy {body.name!r} version {version!r} is already registered (id {existing.id}) "
                           f"with checkpoint {existing.checkpoint_sha256[:12]}…, but {body.endpoint} serves "
                           f"{meta.checkpoint_sha256[:12]}…; register it under another version",
                           {"policy_id": existing.id})
        response.status_code = 200
        policy = queries.update_policy_endpoint(session, existing, body.endpoint)
    else:
        try:
            policy = queries.create_policy(
                session, name=body.name, version=version, endpoint=body.endpoint,
                checkpoint_sha256=meta.checkpoint_sha256, state_dim=meta.state_dim, action_dim=meta.action_dim,
                chunk_size=meta.chunk_size, tasks=meta.tasks)
        except queries.Conflict as exc:  # registered concurrently
            raise ApiError(409, "policy_version_exists", f"{exc}; register it under another version") from exc
    response.headers["Location"] = f"/policies/{policy.id}"
    return policy


@router.get("", response_model=Page[PolicyOut], responses=error_responses(401, 403, 422))
def list_policies(session: SessionDep, settings: SettingsDep, _read: ReadAccessDep,
                  cursor: Annotated[str | None, Query(max_length=200)] = None,
                  limit: Annotated[int, Query(ge=1, le=10_000)] = 50) -> Page[PolicyOut]:
    """Registered policies, newest first."""
    limit = page_limit(limit, settings.max_page_size)
    before = decode_page_cursor(cursor, "policy")
    rows = queries.list_policies(session, before_id=before, limit=limit + 1)
    items = [PolicyOut.model_validate(row) for row in rows[:limit]]
    return Page(items=items, next_cursor=encode_cursor("policy", items[-1].id) if len(rows) > limit else None)


@router.get("/{policy_id}", response_model=PolicyOut, responses=error_responses(401, 403, 404, 422))
def get_policy(policy_id: Annotated[int, Path(ge=1, le=MAX_ID)], session: SessionDep,
               _read: ReadAccessDep) -> Policy:
    """One policy."""
    policy = queries.get_policy(session, policy_id)
    if policy is None:
        raise ApiError(404, "not_found", f"no policy with id {policy_id}; GET /policies lists them")
    return policy

