"""Weight version labels as SGLang reports them, read the same way by every service."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def parse_weight_version(value: Any) -> int:
    """SGLang's version label as an int: "default" (initial weights) -> 0, "12" -> 12.

    A label that is not an integer is logged and read as 0 (never raises).
    """
    if value in (None, "", "default"):
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        log.warning("non-integer weight_version %r recorded as 0", value)
        return 0
