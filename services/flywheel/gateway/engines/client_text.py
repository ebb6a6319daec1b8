"""Engine failures in words for the client: no internal engine address in them.

The gateway tells a client why no engine served its request ("HTTP 503 the engine is loading",
"connection refused: ..."); the lines it builds name each engine by its URL, which is the
deployment's internal address (`http://10.0.3.7:30000`) and stays in the gateway's log. The
client's message names the engines by their place among those tried ("engine 1", "engine 2").
"""

from __future__ import annotations

import re

URL = re.compile(r"https?://[^\s;,()/:]+(?::\d+)?(?:/[^\s;,():]*)*")
"""An http(s) URL: scheme, host, optional port and path (the `: ` after it is not part of it)."""


def without_urls(lines: list[str]) -> list[str]:
    """`lines` with every URL replaced by the engine's place among those named, in order of
    first mention.

    Example: ["http://127.0.0.1:30000: HTTP 503 busy", "http://10.0.0.2:30000: no answer",
    "http://127.0.0.1:30000: connection refused"] -> ["engine 1: HTTP 503 busy", "engine 2: no
    answer", "engine 1: connection refused"].
    """
    names: dict[str, str] = {}

    def name(match: re.Match[str]) -> str:
        return names.setdefault(match.group(0), f"engine {len(names) + 1}")

    return [URL.sub(name, line) for line in lines]
