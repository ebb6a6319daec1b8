"""Admin routes for the engine fleet (admin key): `GET /v1/admin/engines` lists the fleet,
`POST /v1/admin/engines {"url": ...}` adds an engine (it serves once it has the fleet's
weights), `DELETE /v1/admin/engines?url=...` removes one (only its sessions move; the last engine in
service only with `&force=true`, else a 409). Every gateway
and the trainer see the change within `fleet.refresh_s` (the fleet is in Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict

from flywheel.core.errors import ConflictError, InvalidRequestError, NotFoundError
from flywheel.core.fleet import normalize_url
from flywheel.gateway.access.principal import require_role
from flywheel.gateway.engines.fleet_watch import FleetWatch

router = APIRouter()


class EngineAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    """Engine base URL, e.g. http://10.0.0.7:30000."""


def _watch(request: Request) -> FleetWatch:
    watch: FleetWatch | None = getattr(request.app.state.deps, "fleet", None)
    if watch is None:
        raise InvalidRequestError(
            "this gateway was started without a shared fleet (an embedded app); engines come "
            "from gateway.engine_urls"
        )
    return watch


def _url(url: str) -> str:
    try:
        return normalize_url(url)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="url") from None


@router.get("/v1/admin/engines", dependencies=[Depends(require_role("admin"))])
async def list_engines(request: Request) -> dict[str, Any]:
    watch = _watch(request)
    version = await asyncio.to_thread(watch.fleet.version)
    return {"object": "list", "weight_version": version, "data": await watch.describe()}


@router.post("/v1/admin/engines", dependencies=[Depends(require_role("admin"))])
async def add_engine(body: EngineAdd, request: Request) -> dict[str, Any]:
    watch = _watch(request)
    url = _url(body.url)
    added = await asyncio.to_thread(watch.fleet.add, url)
    await watch.refresh()  # this gateway sees it at once; the others within fleet.refresh_s
    answer: dict[str, Any] = {"url": url, "added": added, "state": _state(watch, url)}
    if await watch.pool.served_version(url) is None:
        answer["detail"] = (
            f"{url} does not answer /model_info: it stays pending (routed no request) until it "
            "answers and serves the fleet's weight version; check the address"
        )
    return answer


@router.delete("/v1/admin/engines", dependencies=[Depends(require_role("admin"))])
async def remove_engine(
    request: Request, url: str = Query(...), force: bool = Query(False)
) -> dict[str, Any]:
    """Remove `url` from the fleet. Removing the last engine in service (this gateway's view)
    is a 409 unless `force=true`: every request would then be a 502 until another one serves.

    Raises:
        InvalidRequestError: not an engine URL (400).
        ConflictError: the last engine in service, without `force` (409).
        NotFoundError: not in the fleet (404).
    """
    watch = _watch(request)
    url = _url(url)
    if not force and watch.pool.urls == [url]:
        raise ConflictError(
            f"engine {url} is the last engine in service: removing it leaves no engine to serve "
            "any request (every request a 502) until another one serves the fleet's weights. "
            "Add one first (POST /v1/admin/engines), or pass force=true to remove it anyway",
            param="url",
            code="last_engine",
        )
    if not await asyncio.to_thread(watch.fleet.remove, url):
        raise NotFoundError(f"engine {url} is not in the fleet (GET /v1/admin/engines lists it)")
    await watch.refresh()
    return {"url": url, "removed": True}


def _state(watch: FleetWatch, url: str) -> str:
    if url in watch.pool.pending:
        return "pending"
    return "in_service" if url in watch.pool.urls else "unseen"
