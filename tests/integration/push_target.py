"""A stand-in engine for trainer tests: an HTTP server that takes weight pushes
(`POST /update_weights_from_disk` and the pause/continue calls) and, optionally, answers
`GET /model_info` with the version it last took. Subclasses decide how a push is answered."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class PushTarget:
    """Records pushes; `on_push(path, body)` returns (HTTP status, JSON reply)."""

    serves_model_info = True

    def __init__(self) -> None:
        self.served = "default"
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if not target.serves_model_info:
                    self.send_error(501)  # as a server without the route
                    return
                self._reply(200, {"weight_version": target.served})

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._reply(*target.on_push(self.path, body))

            def _reply(self, status: int, data: dict[str, Any]) -> None:
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def on_push(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Take the push: serve its version from now on."""
        if "weight_version" in body:
            self.served = body["weight_version"]
        return 200, {"success": True, "message": "ok"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
