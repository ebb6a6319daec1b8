"""Request rules OpenAI's API enforces that the request models alone do not express.

- Message content: `null` (or absent) content is accepted only on an assistant message that
  carries `tool_calls` (or a legacy `function_call`); anywhere else it is a 400 naming
  `messages[i].content`.
- Tool results (`stale_tool_result`): on the Responses and Messages APIs a tool result whose id
  answers no tool call earlier in the conversation is a 400, as OpenAI's Responses API and
  Anthropic's API answer (each in its own words and error format).
- Model names: with `gateway.served_model_names` set, a request for another model is a 404
  with code `model_not_found` (OpenAI's answer); empty = any name is served.
"""

from __future__ import annotations

from typing import Any

from flywheel.core.errors import InvalidRequestError, NotFoundError
from flywheel.core.settings import GatewaySettings
from flywheel.gateway.api.schemas import ChatMessage


class ModelNotFoundError(NotFoundError):
    """HTTP 404 for a model this gateway does not serve (OpenAI: `invalid_request_error`,
    code `model_not_found`)."""

    error_type = "invalid_request_error"


def served_models(settings: GatewaySettings) -> list[str]:
    """The model ids `GET /v1/models` lists: `served_model_names`, else `model_name`."""
    return list(settings.served_model_names) or [settings.model_name]


def check_model(settings: GatewaySettings, model: str) -> None:
    """Refuse a model name outside `served_model_names` (when set; an empty name is the default
    model).

    Raises:
        ModelNotFoundError: the name is not served (404, code `model_not_found`, param `model`).
    """
    names = settings.served_model_names
    if names and model and model not in names:
        raise ModelNotFoundError(
            f"The model `{model}` does not exist or you do not have access to it; this gateway "
            f"serves {names}",
            param="model",
            code="model_not_found",
        )


def check_contents(messages: list[ChatMessage]) -> None:
    """Refuse messages without content, except an assistant message with tool calls.

    Raises:
        InvalidRequestError: 400 with param `messages[i].content` for the first such message.
    """
    for i, m in enumerate(messages):
        if m.content is not None:
            continue
        extra = m.model_extra or {}
        if m.role == "assistant" and (m.tool_calls or extra.get("function_call")):
            continue  # OpenAI: content is optional next to tool calls (or a legacy function call)
        need = "content or tool_calls" if m.role == "assistant" else "content"
        raise InvalidRequestError(
            f"messages[{i}]: a {m.role} message needs {need}; got null",
            param=f"messages[{i}].content",
        )


def stale_tool_result(messages: list[dict[str, Any]]) -> tuple[int, str] | None:
    """The first tool message whose `tool_call_id` matches no tool call of an earlier assistant
    message, as (its index in `messages`, the id); None when every tool result answers a call.
    Messages are chat dicts (`role`, `tool_calls[].id`, `tool_call_id`); a tool message without
    an id is not checked.

    Example: [{"role": "assistant", "tool_calls": [{"id": "c1", ...}]},
    {"role": "tool", "tool_call_id": "c1"}, {"role": "tool", "tool_call_id": "c9"}] -> (2, "c9").
    """
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            called.update(c.get("id") for c in message.get("tool_calls") or [] if c.get("id"))
        elif message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str) and call_id not in called:
                return i, call_id
    return None
