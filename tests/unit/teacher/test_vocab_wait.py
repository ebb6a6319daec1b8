"""check_served_vocab waits for a teacher engine that is still loading its model (HTTP 503)
instead of refusing it as another vocabulary. Found running the compose `cpu,teacher` profile
in podman, which starts the teacher without waiting for the teacher engine's health check.
The engine here is a stand-in HTTP server (the real-engine cases are in
tests/contract/test_teacher_served_vocab.py and tests/deploy/test_compose_podman.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoTokenizer

from flywheel.teacher.vocab import check_served_vocab


def _engine(tokenizer, loading_replies: int) -> Iterator[tuple[str, list[int]]]:
    """A server whose /generate answers 503 `loading_replies` times, then echoes each input id
    with the text `tokenizer` gives it (what an engine serving that model answers)."""
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(self.server.server_port)
            if len(seen) <= loading_replies:
                reply, status = {"error": {"message": "the engine is loading"}}, 503
            else:
                ids = body["input_ids"]
                texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
                rows = [[None, i, text] for i, text in zip(ids, texts, strict=True)]
                reply, status = {"meta_info": {"input_token_logprobs": rows}}, 200
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_a_loading_engine_is_waited_for_then_checked(tokenizer):
    for url, seen in _engine(tokenizer, loading_replies=2):
        check_served_vocab(url, tokenizer, timeout_s=5, wait_s=30)
        assert len(seen) == 3  # two 503 replies while loading, then the probe answered


def test_an_engine_loading_past_the_wait_is_a_timeout_naming_the_503(tokenizer):
    for url, seen in _engine(tokenizer, loading_replies=10**6):
        with pytest.raises(TimeoutError, match="HTTP 503 .loading.*the engine is loading"):
            check_served_vocab(url, tokenizer, timeout_s=5, wait_s=1.5)
        assert len(seen) >= 2
