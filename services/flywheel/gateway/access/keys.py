"""Key-management routes of the gateway: per-session keys for a session's owner, and the admin
API for agent/admin keys (`flywheel keys` does the same from the command line)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from flywheel.core.auth import KeyStore
from flywheel.gateway.access.principal import principal, require_role
from flywheel.gateway.session.owner import check_request_owner
from flywheel.gateway.session.store import SessionStore


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["agent", "admin"] = "agent"
    name: str = ""
    train: bool = True
    """False = not for training (served, never recorded)."""


class KeyTrain(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: bool


def _store(request: Request) -> KeyStore:
    return request.app.state.key_store


router = APIRouter()


@router.post("/v1/sessions/{session_id}/keys")
async def mint_session_key(session_id: str, request: Request) -> dict[str, Any]:
    """A key routed to this session (for harnesses that can only set base_url and api_key)."""
    who = principal(request)
    sessions: SessionStore = request.app.state.deps.sessions
    check_request_owner(await asyncio.to_thread(sessions.get, session_id))  # 404: missing
    secret, record = await asyncio.to_thread(
        _store(request).create,
        "session",
        session_id=session_id,
        parent=who.limit_id if who.key_id else "",
        ttl_s=sessions.ttl_s,
        train=who.train,
    )
    base = str(request.base_url).rstrip("/")
    return {
        "api_key": secret,
        "key_id": record.key_id,
        "session_id": session_id,
        "base_url": f"{base}/v1",
    }


@router.get("/v1/admin/keys", dependencies=[Depends(require_role("admin"))])
async def list_keys(request: Request) -> dict[str, Any]:
    records = await asyncio.to_thread(_store(request).list)
    return {"object": "list", "data": [r.model_dump() for r in records]}


@router.post("/v1/admin/keys", dependencies=[Depends(require_role("admin"))])
async def create_key(body: KeyCreate, request: Request) -> dict[str, Any]:
    secret, record = await asyncio.to_thread(
        _store(request).create, body.role, body.name, train=body.train
    )
    return {"api_key": secret, **record.model_dump()}


@router.patch("/v1/admin/keys/{key_id}", dependencies=[Depends(require_role("admin"))])
async def mark_key(key_id: str, body: KeyTrain, request: Request) -> dict[str, Any]:
    """Mark a key for training or not (`{"train": false}`)."""
    record = await asyncio.to_thread(_store(request).set_train, key_id, body.train)
    return record.model_dump()


@router.delete("/v1/admin/keys/{key_id}", dependencies=[Depends(require_role("admin"))])
async def revoke_key(key_id: str, request: Request) -> dict[str, Any]:
    """Revoke a key; `keys_left` 0 means every request is refused from now on (keys stay
    required once a deployment had one, docs/security.md)."""
    record = await asyncio.to_thread(_store(request).revoke, key_id)
    left = await asyncio.to_thread(_store(request).keys_left)
    return {"key_id": record.key_id, "revoked": True, "keys_left": left}
