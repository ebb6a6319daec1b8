"""Who sent a request (`Principal`, set by the security middleware) and the route-side checks
on it: the owner a new session gets, the roles a route allows."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from flywheel.core.auth import KeyRecord, Role
from flywheel.core.errors import AuthenticationError, PermissionDeniedError


@dataclass(frozen=True)
class Principal:
    """Who sent a request. `key_id` "" = the local admin (authentication off)."""

    key_id: str
    role: Role
    session_id: str = ""
    """For session keys: the only session this principal may use."""
    limit_id: str = "local"
    """Identity rate and concurrency limits count against."""
    train: bool = True
    """False: the key is not for training (its turns are served, never recorded)."""

    @classmethod
    def of(cls, record: KeyRecord) -> Principal:
        return cls(record.key_id, record.role, record.session_id, record.limit_id, record.train)


LOCAL_ADMIN = Principal(key_id="", role="admin")
ANONYMOUS = Principal(key_id="anonymous", role="agent", limit_id="anonymous")
"""Who calls a public path (and `/metrics` when it does not need an admin key) without a key."""


def principal(request: Request) -> Principal:
    """The authenticated principal of a request (set by the middleware).

    Raises:
        AuthenticationError: the security middleware is not installed on this app.
    """
    found = request.scope.get("state", {}).get("principal")
    if found is None:
        raise AuthenticationError("no authenticated principal on this request")
    return found


def owner_of(request: Request) -> str:
    """The owner id a session created by this request gets ("" when authentication is off)."""
    return principal(request).key_id


def require_role(*roles: Role) -> Callable[[Request], Awaitable[Principal]]:
    """A FastAPI dependency allowing only `roles` (admin is always allowed).

    Usage: `@router.get("/dashboard", dependencies=[Depends(require_role("admin"))])`, or
    `who: Annotated[Principal, Depends(require_role("agent"))]`.

    Raises (from the dependency):
        AuthenticationError: no principal (middleware not installed).
        PermissionDeniedError: the key's role is not allowed.
    """
    allowed = set(roles) | {"admin"}

    async def dependency(request: Request) -> Principal:
        who = principal(request)
        if who.role not in allowed:
            raise PermissionDeniedError(
                f"this endpoint needs a key with role {' or '.join(sorted(allowed))}; "
                f"yours has role {who.role}"
            )
        return who

    return dependency
