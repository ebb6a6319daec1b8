"""Logging set-up shared by services: one line per record, JSON when `FLYWHEEL_LOG_JSON=1`."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("sample_id", "session_id", "stream"):
            if hasattr(record, key):
                data[key] = getattr(record, key)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data)


def setup_logging(level: str = "INFO", service: str = "flywheel") -> None:
    """Configure the root logger once per process (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("FLYWHEEL_LOG_JSON") == "1":
        handler.setFormatter(_JsonFormatter(service))
    else:
        fmt = logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
