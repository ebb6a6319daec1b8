"""One corrected live turn on a running stack, and the wait for its Samples on the `train`
stream: shared by the live-mode stack tests (test_openclaw_live.py, test_teacher_stack.py).

The turn: a live session whose turn 0 answers QUESTION through the official `openai` SDK; the
user's next message, CORRECTION, is that turn's next state (what the judge and the hint read).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai

from flywheel._proto import sample_pb2
from flywheel.core.codec import decode_sample
from flywheel.core.redis_client import connect
from flywheel.core.settings import FlywheelSettings
from flywheel.core.streams import FIELD

QUESTION = "What is 7 + 1?"
CORRECTION = "No, that is wrong. 7 + 1 = 8. Reply with just the number."
MODEL = "SmolLM2-135M-Instruct"


def corrected_turn(gateway: str, task: dict[str, Any], *, correction_max_tokens: int) -> str:
    """Turn 0 answers QUESTION (8 tokens at most); the user's CORRECTION follows with a reply of
    `correction_max_tokens` tokens at most. Returns the session id."""
    session = httpx.post(f"{gateway}/v1/sessions", json={"mode": "live", "task": task}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="test")
    first = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model=MODEL, messages=first, temperature=1.0, max_tokens=8
    )
    answer = {"role": "assistant", "content": reply.choices[0].message.content}
    client.chat.completions.create(
        model=MODEL,
        temperature=1.0,
        max_tokens=correction_max_tokens,
        messages=[*first, answer, {"role": "user", "content": CORRECTION}],
    )
    return session["session_id"]


def train_samples(
    settings: FlywheelSettings,
    session_id: str,
    *,
    turn_index: int | None = None,
    n: int = 1,
    timeout_s: float = 120.0,
) -> list[sample_pb2.Sample]:
    """The Samples of `session_id` (only turn `turn_index`, when given) on the train stream,
    in stream order, once there are at least `n`.

    Raises:
        AssertionError: fewer than `n` after `timeout_s` seconds (the dead letters say why).
    """
    client = connect(settings.redis_url())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [decode_sample(f[FIELD]) for _, f in client.xrange(settings.streams.key("train"))]
        mine = [s for s in got if s.session_id == session_id and turn_index in (None, s.turn_index)]
        if len(mine) >= n:
            return mine
        time.sleep(0.25)
    dead = client.xrange(settings.streams.key("dead"))
    raise AssertionError(f"no train sample for {session_id}; dead letters: {dead}")
