"""JSON text of values that may hold client- or model-provided integers of any width.

orjson is the fast path, but it refuses integers wider than 64 bits (`TypeError: Integer exceeds
64-bit range`), which JSON allows and clients send (a tool schema's `maximum`, `metadata`) or the
model samples (a tool call's arguments). Such a value is written by the standard library instead,
so an answer or stream event never fails after its status was sent.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON bytes; integers of any width written exactly.

    Raises:
        TypeError: `value` holds something JSON cannot express (neither library writes it).
    """
    try:
        return orjson.dumps(value)
    except TypeError:  # integers beyond 64 bits; anything else fails in json.dumps too
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def dumps_str(value: Any) -> str:
    """`dumps(value)` as a str (for SSE `data:` lines)."""
    return dumps(value).decode()
