"""The agent: an ordinary program on the official `openai` SDK. It knows nothing about RL.

It gets a base_url (a gateway session URL) and a question, and returns the model's reply.
"""

from __future__ import annotations

import threading

from openai import OpenAI

from flywheel.ops.demo.cancel import openai_http_client


def answer(
    base_url: str,
    question: str,
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    api_key: str = "flywheel-local",
    stopping: threading.Event | None = None,
) -> str:
    """Ask the model one question through `base_url`; returns the reply text. Once `stopping`
    is set its requests raise `EpisodeCancelled` (`cancel.py`)."""
    # closed on return: its connection pool and TLS context go at once, not at the next
    # garbage collection (the demo runs 32 of these at a time)
    http = openai_http_client(stopping)
    with OpenAI(
        base_url=base_url, api_key=api_key, max_retries=5, timeout=600, http_client=http
    ) as client:
        completion = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=temperature,
            max_tokens=max_tokens,
        )
    return completion.choices[0].message.content or ""
