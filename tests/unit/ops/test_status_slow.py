"""`flywheel status` tells a service that accepts the connection but answers too late (an
engine busy under load) as "slow", not DOWN, and does not count it as out of service for the
exit code; a refused connection stays DOWN. The reasons are words, not exception class names."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from flywheel.ops.status import ServiceHealth, StatusReport, probe, served_weight_version
from tests.unit.core.http_stub import JsonHandler, serving

RELEASE = threading.Event()


class Busy(JsonHandler):
    """Accepts every request and answers only once the test is over."""

    def do_GET(self):  # noqa: N802
        RELEASE.wait()
        self._json(200, {"weight_version": "3"})


@pytest.fixture
def busy() -> Iterator[str]:
    RELEASE.clear()
    with serving(Busy) as url:
        try:
            yield url
        finally:
            RELEASE.set()


def _refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_health_probe_without_an_answer_in_time_is_slow_not_down(busy):
    health = probe("engine", "http", busy + "/health", timeout_s=0.2)
    assert health.slow and not health.healthy
    assert health.detail == "no answer within 0.2 s (busy?)"
    assert served_weight_version(busy, timeout_s=0.2) == "slow"


def test_a_refused_connection_is_down_in_words():
    health = probe("engine", "http", _refused_url() + "/health", timeout_s=1)
    assert not health.slow and not health.healthy
    assert health.detail == "connection refused"
    assert served_weight_version(_refused_url(), timeout_s=1) is None


def _report(service: ServiceHealth, engine_state: str) -> StatusReport:
    engines = [{"url": "http://e", "source": "static", "state": engine_state}]
    return StatusReport([service], "redis://x", True, "", [], engines, None)


def test_a_slow_service_is_not_out_of_service_for_the_exit_code():
    slow = ServiceHealth("engine", "http://e/health", False, "no answer", slow=True)
    assert _report(slow, "slow").healthy
    down = ServiceHealth("engine", "http://e/health", False, "connection refused")
    assert not _report(down, "in_service").healthy
    assert not _report(slow, "down").healthy
