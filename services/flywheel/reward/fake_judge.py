"""A fake OpenAI-compatible judge over real HTTP (ThreadingHTTPServer, a free port), so the
reward stage runs alone (tests, bench/reward.py's "instant judge") without a model.

Behaviour is chosen by a marker in the prompt, so one server can serve well-behaved and
misbehaving samples side by side: HANG (sleeps `hang_s` seconds before answering), FAIL500
(HTTP 500), GARBAGE (a reply with no verdict line); otherwise "Final verdict: +1", or
"Final score: 7" when the prompt asks for a score. `python -m flywheel.reward.fake_judge PORT`
serves it in the foreground.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # many concurrent votes connect at once
    daemon_threads = True


class FakeJudge:
    """Start serving on construction; `url` is the /v1 root; `close()` stops it."""

    def __init__(self, hang_s: float = 5.0, port: int = 0):
        self.hang_s = hang_s
        self.calls: list[str] = []
        self.in_flight = 0
        self.peak = 0
        """Most requests being answered at once so far."""
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real server

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                with judge.lock:
                    judge.calls.append(prompt)
                    judge.in_flight += 1
                    judge.peak = max(judge.peak, judge.in_flight)
                try:
                    self._answer(prompt)
                finally:
                    with judge.lock:
                        judge.in_flight -= 1

            def _answer(self, prompt):
                if "HANG" in prompt:
                    time.sleep(judge.hang_s)
                if "FAIL500" in prompt:
                    self._send(500, {"error": {"message": "boom"}})
                    return
                if "GARBAGE" in prompt:
                    text = "I think it is fine, maybe."
                elif "Final score" in prompt:
                    text = "Clear and correct.\nFinal score: 7"
                else:
                    text = "The user moved on happily.\nFinal verdict: +1"
                self._send(
                    200,
                    {
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": text},
                            }
                        ]
                    },
                )

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

        self.server = _Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, marker: str) -> int:
        with self.lock:
            return sum(marker in p for p in self.calls)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    judge = FakeJudge(port=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(judge.url, flush=True)
    judge.thread.join()
