"""Which key may use a session: the request's owner, checked against the stored record.

The security middleware (access/security.py) sets `REQUEST_OWNER` for agent keys; the session
lock (locks.py) and routes that read a record without the lock call `check_request_owner`.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from pydantic import BaseModel

from flywheel.core.errors import NotFoundError
from flywheel.gateway.recording.records import SessionRecord

log = logging.getLogger(__name__)


class Owner(BaseModel):
    """The one field of a stored SessionRecord that access checks need."""

    owner: str = ""


REQUEST_OWNER: ContextVar[str | None] = ContextVar("flywheel_request_owner", default=None)
REQUEST_TRAIN: ContextVar[bool] = ContextVar("flywheel_request_train", default=True)
"""False while serving a request of a key marked not for training (set by the middleware):
its turns are served outside any session and never recorded."""
"""The key whose sessions the current request may use (the security middleware sets it for
agent keys; None: any, for admins, for session keys, which are confined to their session, and
without authentication). `locks.locked` checks it under the session lock, so a session another
key created between the access check and the turn (two first requests naming one new
X-Session-Id at once) is refused there; routes that read a record without the lock call
`check_request_owner`."""


def not_for_this_key(session_id: str) -> NotFoundError:
    """The 404 a key gets for a session it may not use: the same words whether the session is
    missing, another key's, or was created without a key (while authentication was off, so it
    has no owner), so a key cannot tell which session ids exist; the message names every case,
    so a client whose sessions predate the first key knows why. Only admin keys use sessions
    that are not their own."""
    return NotFoundError(
        f"session {session_id} not found for this key: no such session, or it belongs to "
        "another key, or it was created without a key (before API keys were required); only an "
        "admin key can use a session it did not create",
        param="session_id",
    )


def check_request_owner(record: SessionRecord) -> None:
    """Refuse `record` when the current request's key may not use it (`REQUEST_OWNER`).

    Raises:
        NotFoundError: the session belongs to another key or to none (`not_for_this_key`).
    """
    owner = REQUEST_OWNER.get()
    if owner is not None and record.owner != owner:
        log.warning(
            "key %s refused session %s of another key (created after its access check)",
            owner,
            record.session_id,
        )
        raise not_for_this_key(record.session_id)
