"""Stored responses for `previous_response_id` (Responses API `store`), kept in Redis.

One key per response, `<prefix>:response:<id>`, holding JSON `{"owner", "session_id",
"conversation"}`: the key that created it (another key's id is answered like a missing one, a
404), the session its turn was recorded in ("" when unrecorded) and the conversation as chat
messages (the input of every response of the chain, then its reply exactly as recorded, with
tool call ids and argument strings as sampled; never the instructions). The key expires
`gateway.response_ttl_s` seconds after it was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import redis

from flywheel.core.errors import NotFoundError
from flywheel.core.redis_client import LoopClients
from flywheel.gateway.api.json_text import dumps


@dataclass
class StoredResponse:
    owner: str
    session_id: str
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Args: client: the gateway's Redis client; prefix: the deployment's key prefix; ttl_s:
    seconds a stored response is kept."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int):
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._clients = LoopClients(client)

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store a response (one SET with expiry)."""
        value = dumps(
            {
                "owner": stored.owner,
                "session_id": stored.session_id,
                "conversation": stored.conversation,
            }
        )
        await self._clients.get().set(self._key(response_id), value, ex=self.ttl_s)

    async def get(self, response_id: str, owner: str) -> StoredResponse:
        """The stored response `response_id` of `owner`.

        Raises:
            NotFoundError: none stored (never, expired, `store: false`) or another key's
                (param `previous_response_id`).
        """
        raw = await self._clients.get().get(self._key(response_id))
        data = orjson.loads(raw) if raw is not None else None
        if data is None or data.get("owner", "") != owner:
            raise NotFoundError(
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
            )
        return StoredResponse(data["owner"], data.get("session_id", ""), data["conversation"])
