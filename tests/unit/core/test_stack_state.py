"""running_stack: a state file left by a dead `flywheel up` is not a running stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from flywheel.stack import STATE_FILE, running_stack


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_state_of_a_dead_up_is_ignored_even_when_its_gateway_port_answers(tmp_path):
    # Another stack now answers on the recorded gateway port: only the pid tells them apart.
    server = HTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = f"http://127.0.0.1:{server.server_port}"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / STATE_FILE).write_text(json.dumps({"pid": dead.pid, "gateway": gateway}))
        assert running_stack(str(tmp_path)) is None
        (tmp_path / STATE_FILE).write_text(json.dumps({"pid": os.getpid(),
                                                       "gateway": gateway}))
        assert running_stack(str(tmp_path)) == {"pid": os.getpid(), "gateway": gateway}
    finally:
        server.shutdown()
