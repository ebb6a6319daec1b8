"""API keys: generation, hashing, roles and the key store in Redis (docs/security.md).

A key is a random secret shown once at creation. Redis holds only its SHA-256 digest: the
secrets carry 256 bits of entropy, so a fast unsalted hash cannot be reversed by guessing, and
lookups stay one GET. Roles:

- `admin`: everything, including control paths (admin API, dashboard, metrics when configured)
  and any session.
- `agent`: inference and the sessions it created (a session belongs to the key that made it).
- `session`: minted for one session; its requests are routed to that session (the third way to
  name a session, after the URL `/s/<id>/v1` and the `X-Session-Id` header). It can only chat in
  that session: it cannot create, read, reward or finish sessions. Limits count it against the
  key that minted it (`parent`).

Layout under the deployment prefix: `<prefix>:apikey:<sha256 hex>` -> KeyRecord JSON;
`<prefix>:apikeys` hash key_id -> digest, for listing and revoking agent/admin keys (session keys
expire with their session instead and are not listed, so they never switch `auth = "auto"` on);
`<prefix>:apikeys:required`, set when the first agent/admin key is created (or one is revoked)
and never removed: under `auth = "auto"` keys stay required once a deployment has had one, so
revoking the last key refuses every request instead of silently serving everyone as admin.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Literal

import redis
from pydantic import BaseModel, Field

from flywheel.core.errors import InvalidRequestError, NotFoundError
from flywheel.core.redis_client import as_str

Role = Literal["agent", "admin", "session"]
ROLE_PREFIX = {"agent": "fwk-", "admin": "fwk-", "session": "fws-"}
KEY_PREFIXES = ("fwk-", "fws-")
"""Every Flywheel key starts with one of these; other bearer tokens are never looked up."""


class KeyRecord(BaseModel):
    """What the store knows about a key (never the key itself)."""

    key_id: str
    """Public id (12 hex chars) shown in listings and logs; not a secret."""
    role: Role
    name: str = ""
    session_id: str = ""
    """For `session` keys: the one session this key may use."""
    parent: str = ""
    """For `session` keys: key_id of the key that minted it (limits are counted against it)."""
    created_at: float = Field(default_factory=time.time)
    train: bool = True
    """False = not for training: the key's turns are served and never recorded or published
    (docs/security.md "Not for training"); session keys minted by it inherit it."""

    @property
    def limit_id(self) -> str:
        """Identity that rate and concurrency limits count against."""
        return self.parent or self.key_id


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key (64 chars): what Redis stores instead of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(role: Role) -> str:
    """A fresh secret: role prefix + 43 url-safe chars (256 random bits)."""
    return ROLE_PREFIX[role] + secrets.token_urlsafe(32)


class KeyStore:
    """API keys in Redis, stored hashed.

    Args:
        client: redis-py client (bytes responses).
        prefix: deployment key prefix (`streams.prefix`).
    """

    def __init__(self, client: redis.Redis, prefix: str):
        self.client = client
        self.prefix = prefix

    def _key(self, digest: str) -> str:
        return f"{self.prefix}:apikey:{digest}"

    @property
    def _index(self) -> str:
        return f"{self.prefix}:apikeys"

    @property
    def _required(self) -> str:
        return f"{self.prefix}:apikeys:required"

    def create(
        self,
        role: Role,
        name: str = "",
        *,
        session_id: str = "",
        parent: str = "",
        ttl_s: int | None = None,
        train: bool = True,
    ) -> tuple[str, KeyRecord]:
        """Mint a key; returns (secret shown once, its record). `train` False = not for
        training (`KeyRecord.train`).

        Raises:
            InvalidRequestError: a `session` key without `session_id`, or an unknown role.
        """
        if role not in ROLE_PREFIX:
            raise InvalidRequestError(f"unknown role {role!r}; use agent or admin", param="role")
        if (role == "session") != bool(session_id):
            raise InvalidRequestError(
                "a session key needs exactly one session_id", param="session_id"
            )
        secret = new_key(role)
        digest = hash_key(secret)
        record = KeyRecord(
            key_id=digest[:12],
            role=role,
            name=name,
            session_id=session_id,
            parent=parent,
            train=train,
        )
        pipe = self.client.pipeline()
        pipe.set(self._key(digest), record.model_dump_json(), ex=ttl_s)
        if role != "session":
            pipe.hset(self._index, record.key_id, digest)
            pipe.set(self._required, "1")
        pipe.execute()
        return secret, record

    def verify(self, secret: str) -> KeyRecord | None:
        """The record of a presented key, or None when it is unknown or revoked."""
        if not secret.startswith(KEY_PREFIXES):
            return None
        digest = hash_key(secret)
        raw = self.client.get(self._key(digest))
        if raw is None:
            return None
        record = KeyRecord.model_validate_json(raw)
        # The digest is the lookup key already; this guards against a corrupted record.
        if not hmac.compare_digest(record.key_id, digest[:12]):
            return None
        return record

    def list(self) -> list[KeyRecord]:
        """Agent and admin keys (session keys are not listed)."""
        records = []
        for digest in self.client.hvals(self._index):
            raw = self.client.get(self._key(as_str(digest)))
            if raw is not None:
                records.append(KeyRecord.model_validate_json(raw))
        return sorted(records, key=lambda r: r.created_at)

    def set_train(self, key_id: str, train: bool) -> KeyRecord:
        """Mark an agent/admin key for training (`train` True) or not for training; returns
        its updated record. Takes effect on the gateway within `security.key_cache_s`.

        Raises:
            NotFoundError: no such key.
        """
        digest = self.client.hget(self._index, key_id)
        raw = self.client.get(self._key(as_str(digest))) if digest else None
        if digest is None or raw is None:
            raise NotFoundError(f"API key {key_id} not found", param="key_id")
        record = KeyRecord.model_validate_json(raw).model_copy(update={"train": train})
        self.client.set(self._key(as_str(digest)), record.model_dump_json(), keepttl=True)
        return record

    def revoke(self, key_id: str) -> KeyRecord:
        """Delete an agent/admin key by its id.

        Raises:
            NotFoundError: no such key.
        """
        digest = self.client.hget(self._index, key_id)
        raw = self.client.get(self._key(as_str(digest))) if digest else None
        if digest is None or raw is None:
            raise NotFoundError(f"API key {key_id} not found", param="key_id")
        pipe = self.client.pipeline()
        pipe.delete(self._key(as_str(digest)))
        pipe.hdel(self._index, key_id)
        pipe.set(self._required, "1")  # a deployment that had keys keeps requiring them
        pipe.execute()
        return KeyRecord.model_validate_json(raw)

    def reopen(self) -> None:
        """Let `auth = "auto"` serve without keys again (loopback gateways, within
        `key_cache_s`): the deliberate way back after the last key was revoked.

        Raises:
            InvalidRequestError: agent or admin keys still exist (revoke them first).
        """
        left = self.keys_left()
        if left:
            raise InvalidRequestError(
                f"{left} agent/admin key(s) still exist; revoke them first (`flywheel keys list`)"
            )
        self.client.delete(self._required)

    def keys_left(self) -> int:
        """Agent and admin keys that exist now."""
        return int(self.client.hlen(self._index))

    def any_keys(self) -> bool:
        """True once this deployment has had an agent/admin key, even if every one was revoked
        since (`auth = "auto"` then requires keys: with none left every request is refused,
        never served as the local admin)."""
        return bool(self.client.exists(self._index, self._required))
