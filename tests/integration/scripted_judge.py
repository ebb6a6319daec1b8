"""A deterministic judge engine: a real HTTP process speaking the OpenAI chat-completions
protocol (`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`) whose replies are
known in advance, so the hint judge and the next-state judge can run end to end.

Replies: a prompt that asks for a `[HINT_START] ... [HINT_END]` block (the teacher's hint
prompt) gets `--hint` in that block and `Decision: \\boxed{1}`; any other prompt (the reward
service's PRM prompt) gets a line of reasoning and `Final verdict: <--verdict>`. Every request
body is appended as one JSON line to `--log`.

`python tests/integration/scripted_judge.py --port 0 --hint TEXT --verdict -1 --log PATH`
prints `port N` once listening.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reply_for(prompt: str, hint: str, verdict: str) -> str:
    """The scripted reply to one judge prompt (see the module docstring)."""
    if "[HINT_START]" in prompt:
        block = f"[HINT_START]\n{hint}\n[HINT_END]"
        return f"The user corrected the answer.\n{block}\nDecision: \\boxed{{1}}"
    return f"The next state is a correction.\nFinal verdict: {verdict}"


def make_handler(hint: str, verdict: str, log_path: str) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path in ("/health", "/v1/models"):
                self._send(200, {"object": "list", "data": [{"id": "judge", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": "not found", "type": "not_found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path not in ("/v1/chat/completions", "/chat/completions"):
                self._send(404, {"error": {"message": "not found", "type": "not_found"}})
                return
            with lock, open(log_path, "a") as log:
                log.write(json.dumps(body) + "\n")
            prompt = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
            content = reply_for(prompt, hint, verdict)
            self._send(
                200,
                {
                    "id": "chatcmpl-scripted",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", "judge"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                },
            )

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--hint", required=True)
    parser.add_argument("--verdict", default="-1")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.port), make_handler(args.hint, args.verdict, args.log)
    )
    print(f"port {server.server_address[1]}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
