"""The session id a request's URL names, read from its raw (still percent-encoded) path.

The decoded path splits an id with an encoded slash: `/s/a%2Fb/v1/messages` decodes to
`/s/a/b/v1/messages`, the session "a" with "/b/v1/messages" after it. The raw path keeps the
id one segment, "a/b", which the security middleware refuses and the Messages error middleware
still recognizes as a Messages request.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote


def raw_path_session(scope: dict[str, Any]) -> tuple[str, str] | None:
    """(session id, the path after it), both decoded, of a request to `/s/<id>/...` or
    `/v1/sessions/<id>...`, read from the raw path; None for another path, and when the raw
    path has no `%` (then the decoded path's segments are the raw ones).

    Example: raw path b"/s/a%2Fb/v1/messages?x=1" -> ("a/b", "/v1/messages").
    """
    raw = scope.get("raw_path")
    if not raw or b"%" not in raw:
        return None
    parts = raw.split(b"?", 1)[0].decode("latin-1").split("/")
    if len(parts) > 2 and parts[1] == "s":
        at = 2
    elif len(parts) > 3 and parts[1:3] == ["v1", "sessions"]:
        at = 3
    else:
        return None
    return unquote(parts[at]), "/" + "/".join(unquote(p) for p in parts[at + 1 :])
