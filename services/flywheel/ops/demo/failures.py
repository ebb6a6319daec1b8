"""How the demo words a failed episode, and its check of the gateway's API keys before the first
step: a 401/403 is the client's key (missing, invalid or not allowed), not a server failure."""

from __future__ import annotations

import shlex

import httpx
import openai

from flywheel.ops.demo_cli import API_KEY_ENV


def config_flag(config: str | None) -> str:
    """` --config FILE` (quoted for a shell) for the commands a hint prints when the demo runs
    with `--config FILE`, so they reach the same stack as printed; "" without one."""
    return f" --config {shlex.quote(config)}" if config else ""


def key_hint(config: str | None = None) -> str:
    """How to create an agent key and run the demo with it; `config`: the demo's `--config`
    file, repeated in both commands."""
    flag = config_flag(config)
    return (
        f"create an agent key with `flywheel keys create{flag} --role agent` and pass it with "
        f"`flywheel demo{flag} --api-key KEY` (or env {API_KEY_ENV})"
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


def describe_failure(exc: BaseException, config: str | None = None) -> str:
    """What went wrong in an episode, as the demo prints it after the episode id (`config`:
    the demo's `--config` file, repeated in the key hint's commands).

    Examples: a 401 -> "refused by the gateway (401: missing API key ...): create an agent
    key ..."; a 502 -> "failed on the server, scored 0: InternalServerError: ..."; no
    connection -> "got no answer from the gateway, scored 0: APIConnectionError: ...".
    """
    status = status_of(exc)
    if status in (401, 403):
        return (
            f"refused by the gateway ({status}: {error_message(exc)}), scored 0: the demo's API "
            f"key is missing, invalid or not allowed here; {key_hint(config)}"
        )
    if status is None and isinstance(exc, openai.APIConnectionError | httpx.TransportError):
        where = "got no answer from the gateway"  # timeouts included
    elif status is not None and status < 500:
        where = f"refused by the gateway ({status})"
    else:
        where = "failed on the server"
    return f"{where}, scored 0: {type(exc).__name__}: {exc}"


def access_refusal(
    http: httpx.Client,
    gateway: str,
    api_key: str | None,
    config: str | None = None,
    model: str = "",
) -> str | None:
    """The CLI message refusing to start when the gateway refuses the demo's key (or its lack
    of one): `GET /v1/models` with it answered 401 or 403; or when it does not serve `model`,
    the name every request of the demo asks for (`model_refusal`). None when it is served, or
    when the gateway does not answer at all (the run reports that itself). `config`: the
    demo's `--config` file, repeated in the commands the message names."""
    try:
        reply = http.get(f"{gateway}/v1/models")
    except httpx.HTTPError:
        return None
    if reply.status_code not in (401, 403):
        return model_refusal(http, gateway, reply, model, config) if model else None
    try:
        said = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = reply.text[:200]
    if api_key is None:
        return (
            f"flywheel: the gateway at {gateway} requires an API key ({reply.status_code}: "
            f"{said}) and the demo has none: {key_hint(config)}"
        )
    flag = config_flag(config)
    return (
        f"flywheel: the gateway at {gateway} refused the demo's API key ({reply.status_code}: "
        f"{said}); pass a valid agent or admin key with `flywheel demo{flag} --api-key KEY` or "
        f"env {API_KEY_ENV} (`flywheel keys list{flag}` shows the keys; "
        f"`flywheel keys create{flag} --role agent` makes one)"
    )


def model_refusal(
    http: httpx.Client, gateway: str, models: httpx.Response, model: str, config: str | None
) -> str | None:
    """The CLI message refusing to start when the gateway would answer every request for
    `model` 404 `model_not_found` (`gateway.served_model_names` set without it); None when it
    serves it. `models`: the gateway's answer to `GET /v1/models`.

    A name that `/v1/models` lists is served. One it does not list may still be (with no
    `served_model_names` any name is), so the gateway is asked: a chat request for `model`
    whose message has no content, which it refuses before any generation, 404 when the model
    is not served, 400 for the content when it is.
    """
    try:
        served = [str(m["id"]) for m in models.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return None
    if model in served:
        return None
    try:
        probe = http.post(
            f"{gateway}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": None}]},
        )
        code = probe.json()["error"].get("code")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if probe.status_code != 404 or code != "model_not_found":
        return None
    names = ", ".join(f'"{name}"' for name in served) or "none"
    return (
        f"flywheel: the gateway at {gateway} does not serve the demo's model {model!r}: it "
        f"serves only {names} ([gateway] served_model_names), so every episode and evaluation "
        f'would get 404 "model does not exist". Add "{model}" to [gateway] served_model_names '
        f"in the config{f' {config}' if config else ''} (or leave it empty: any name is "
        "served), then start the stack again"
    )
