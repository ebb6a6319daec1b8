"""How the demo words a failed episode, and its check of the gateway's API keys before the first
step: a 401/403 is the client's key (missing, invalid or not allowed), not a server failure."""

from __future__ import annotations

import httpx
import openai

from flywheel.ops.demo_cli import API_KEY_ENV

KEY_HINT = (
    "create an agent key with `flywheel keys create --role agent` and pass it with "
    f"`flywheel demo --api-key KEY` (or env {API_KEY_ENV})"
)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a refused request (`httpx.HTTPStatusError`, `openai.APIStatusError`),
    else None (no answer: a connection error, a timeout)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code
    return None


def error_message(exc: BaseException) -> str:
    """The gateway's own `error.message` of a refused request when its body has one, else the
    exception's text."""
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            return str(exc.response.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return str(exc)
    if isinstance(exc, openai.APIStatusError) and isinstance(exc.body, dict):
        return str(exc.body.get("message") or exc)
    return str(exc)


def describe_failure(exc: BaseException) -> str:
    """What went wrong in an episode, as the demo prints it after the episode id.

    Examples: a 401 -> "refused by the gateway (401: missing API key ...): create an agent
    key ..."; a 502 -> "failed on the server, scored 0: InternalServerError: ..."; no
    connection -> "got no answer from the gateway, scored 0: APIConnectionError: ...".
    """
    status = status_of(exc)
    if status in (401, 403):
        return (
            f"refused by the gateway ({status}: {error_message(exc)}), scored 0: the demo's API "
            f"key is missing, invalid or not allowed here; {KEY_HINT}"
        )
    if status is None and isinstance(exc, openai.APIConnectionError | httpx.TransportError):
        where = "got no answer from the gateway"  # timeouts included
    elif status is not None and status < 500:
        where = f"refused by the gateway ({status})"
    else:
        where = "failed on the server"
    return f"{where}, scored 0: {type(exc).__name__}: {exc}"


def access_refusal(http: httpx.Client, gateway: str, api_key: str | None) -> str | None:
    """The CLI message refusing to start when the gateway refuses the demo's key (or its lack
    of one): `GET /v1/models` with it answered 401 or 403. None when it is served, or when the
    gateway does not answer at all (the run reports that itself)."""
    try:
        reply = http.get(f"{gateway}/v1/models")
    except httpx.HTTPError:
        return None
    if reply.status_code not in (401, 403):
        return None
    try:
        said = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = reply.text[:200]
    if api_key is None:
        return (
            f"flywheel: the gateway at {gateway} requires an API key ({reply.status_code}: "
            f"{said}) and the demo has none: {KEY_HINT}"
        )
    return (
        f"flywheel: the gateway at {gateway} refused the demo's API key ({reply.status_code}: "
        f"{said}); pass a valid agent or admin key with --api-key KEY or env {API_KEY_ENV} "
        "(`flywheel keys list` shows the keys; `flywheel keys create --role agent` makes one)"
    )
