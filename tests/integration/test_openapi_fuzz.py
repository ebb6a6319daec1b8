"""Schema fuzzing (schemathesis) of every route of the running gateway, with an admin API key,
against the real engine serving SmolLM2: requests the OpenAPI document allows and requests it
does not, at least 1000 in all. No request gets a 5xx, and most generated chat (and, where the
routes exist, Responses and Anthropic Messages) bodies that the schema allows are served: the
document says what the validation accepts (api/json_shapes.py).

Cost: every generated completion cap (`max_tokens`, `max_completion_tokens`,
`max_output_tokens`) is lowered to at most 2 tokens, and set to 2 where the body has none, and
`n` to at most 2, and every string of the body cut to 48 characters (short prompts), before the
request is sent (values the schema allows, so acceptance is not changed). The acceptance ratio
per route is printed (`pytest -s`).

A Messages body whose last message is the assistant's (a prefill) is refused by design (the
gateway records whole turns: docs/token-path.md, "Anthropic Messages API"), and JSON Schema
cannot say "the last item of `messages` has role user", so the document allows it. Such bodies
are counted apart (`... positive prefill`): the majority assertion for `/v1/messages` counts
only bodies that end with a user message.

A tool result must answer a call made earlier in the same body (an Anthropic `tool_result`
names an earlier `tool_use` id; a Responses `function_call_output` an earlier `function_call`
`call_id`), which JSON Schema cannot say either. Before a body is sent, every generated result
that answers no earlier call becomes plain text (a `text` block, a user message): the body stays
one the document allows."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = [pytest.mark.integration, pytest.mark.slow]
POSITIVE_EXAMPLES = 45
MESSAGES_POSITIVE_EXAMPLES = 90
"""Messages bodies: about two thirds of those generated end with an assistant message (prefills,
counted apart), so twice as many are drawn to leave 10 or more that end with a user message."""
NEGATIVE_EXAMPLES = 14
LONGEST_STRING = 48
"""Characters kept of each string in a generating route's body (its prompt's length; every enum
and pattern of the document fits in it)."""
CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
MUST_ACCEPT = {"/v1/chat/completions", "/v1/responses", "/v1/messages"}


def cheap(path: str, body: Any) -> Any:
    """`body` with its completion caps at most 2 (2 where unset), `n` at most 2 and every
    string at most LONGEST_STRING characters (a short prompt)."""
    if not isinstance(body, dict) or not path.endswith(GENERATING):
        return body
    body = _shorten(body)
    _answer_only_earlier_calls(body)
    for cap in CAPS:  # an integer may come as 1069.0 (JSON Schema's integer allows it)
        if isinstance(body.get(cap), int | float) and not isinstance(body[cap], bool):
            body[cap] = min(body[cap], 2)
    if not any(cap in body for cap in CAPS):
        body["max_output_tokens" if path.endswith("/v1/responses") else "max_tokens"] = 2
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
        body["best_of"] = min(body["best_of"], 2)
    return body


def is_prefill(path: str, body: Any) -> bool:
    """Whether `body` is a Messages body whose last message is the assistant's (a prefill,
    refused by design and not expressible in the JSON schema)."""
    if not path.endswith("/v1/messages") or not isinstance(body, dict):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return False
    return messages[-1].get("role") == "assistant"


def _answer_only_earlier_calls(body: dict[str, Any]) -> None:
    """In place: tool results that answer no earlier call become text (see the module doc)."""
    calls: set[Any] = set()
    messages = body.get("messages")
    if isinstance(messages, list):  # Anthropic Messages
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for i, block in enumerate(content):
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "tool_use":
                    calls.add(block.get("id"))
                elif block.get("type") == "tool_result" and block.get("tool_use_id") not in calls:
                    content[i] = {"type": "text", "text": "tool output"}
    items = body.get("input")
    if isinstance(items, list):  # Responses
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                calls.add(item.get("call_id"))
            elif item.get("type") == "function_call_output" and item.get("call_id") not in calls:
                items[i] = {"role": "user", "content": "tool output"}


def _shorten(value: Any) -> Any:
    if isinstance(value, str):
        return value[:LONGEST_STRING]
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    return value


@pytest.mark.timeout(1800)
def test_every_route_fuzzed_with_a_key_no_5xx_and_chat_bodies_mostly_served(keyed_gateway):
    gw = keyed_gateway
    auth = {"Authorization": f"Bearer {gw.admin_key}"}
    schema = schemathesis.openapi.from_url(f"{gw.gateway}/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/s/{session_id}/v1/models"} <= paths
    for op in operations:  # every path parameter is declared
        for name in _path_names(op.path):
            declared = {p.name for p in op.path_parameters}
            assert name in declared, f"{op.method.upper()} {op.path}: {name} undeclared"
    failures: list[str] = []
    statuses: dict[str, Counter[int]] = defaultdict(Counter)
    for op in operations:
        for mode, examples in (
            (
                GenerationMode.POSITIVE,
                MESSAGES_POSITIVE_EXAMPLES
                if op.path.endswith("/v1/messages")
                else POSITIVE_EXAMPLES,
            ),
            (GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES),
        ):
            try:
                _fuzz(op, mode, examples, gw.gateway, auth, failures, statuses)()
            except Unsatisfiable:  # nothing in this operation's schema to break (no body)
                assert mode is GenerationMode.NEGATIVE, op.path
            except Exception as exc:  # a broken answer (a stream cut short): report them all
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc!r}"[:600])
    total = sum(sum(c.values()) for c in statuses.values())
    print(f"\n{total} requests")
    ratios = {}
    for key, counts in sorted(statuses.items()):
        served = sum(n for status, n in counts.items() if status < 400)
        ratios[key] = served / sum(counts.values())
        print(f"{key:60} served {served}/{sum(counts.values())} {dict(counts)}")
    assert not failures, "\n".join(failures[:30])
    assert total >= 1000
    for path in MUST_ACCEPT & paths:
        key = f"POST {path} positive"  # for /v1/messages: the bodies ending with a user message
        assert sum(statuses[key].values()) >= 10, (key, dict(statuses))
        assert ratios[key] > 0.5, (key, dict(statuses[key]))


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def _fuzz(op, mode, examples, base_url, auth, failures, statuses):
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # every failure is listed; none is shrunk
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        if case.body is not None:
            case.body = cheap(op.path, case.body)
        try:
            response = case.call(base_url=base_url, headers=auth, timeout=120)
        except Exception as exc:  # no answer, or a stream cut short
            failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc!r}"[:600])
            return
        key = f"{op.method.upper()} {op.path} {mode.value}"
        if is_prefill(op.path, case.body):
            key += " prefill"
        statuses[key][response.status_code] += 1
        if response.status_code >= 500:
            failures.append(
                f"{op.method.upper()} {op.path} ({mode.value}) -> {response.status_code}: "
                f"{response.text[:300]}\n  body: {str(case.body)[:300]}"
            )

    return check
