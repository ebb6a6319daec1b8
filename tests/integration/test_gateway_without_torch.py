"""The running gateway of a real stack serves chat without torch in its process
(core/tokenizer_only.py): no libtorch mapped, and a real `openai` client's turn is answered."""

from pathlib import Path
from urllib.parse import urlparse

import openai
import psutil


def _listener(port: int) -> psutil.Process:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"nothing listens on port {port}")


def test_gateway_process_serves_without_torch(smol_stack):
    gateway = _listener(urlparse(smol_stack.gateway).port or 80)
    assert "flywheel.gateway" in " ".join(gateway.cmdline())
    client = openai.OpenAI(base_url=f"{smol_stack.gateway}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        extra_headers={"X-Session-Id": "no-torch-check"},
    )
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    libraries = Path(f"/proc/{gateway.pid}/maps").read_text()
    assert "libtorch" not in libraries
    assert "tokenizers" in libraries  # the Rust tokenizer is what it uses instead
