"""Stub HTTP servers for tests of the CLI: `JsonHandler` (a quiet handler with a JSON reply
helper, the base of the ops tests' stub gateways) and `Healthy`, a server answering every GET
200 (`{}`): the gateway of a running stack as `running_stack` and the CLI check it (`/healthz`)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing, with `_json` to answer a JSON body."""

    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Healthy(BaseHTTPRequestHandler):
    """200 `{}` to every GET; logs nothing."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threading server of `handler` on a free local port, served from a thread; yields its
    URL and shuts it down afterwards."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def healthy_gateway() -> contextlib.AbstractContextManager[str]:
    """A `Healthy` server (`serving`): yields its URL."""
    return serving(Healthy)
