"""/generate streaming, /abort_request, /pause_generation and /continue_generation on a live
engine process (docs/engine-protocol.md)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.integration

PROMPT = [1, 504, 3458, 314, 260, 1789]


def events(url: str, body: dict) -> list:
    """Parsed SSE data events of a streaming /generate call ([DONE] kept as the string)."""
    out = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line  # no `event:` names on /generate
    return out


def test_stream_is_cumulative_token_by_token_and_ends_with_done(shared_live_engine):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    chunks = events(shared_live_engine, body)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert len(chunks) == 5  # one per sampled token
    full = httpx.post(f"{shared_live_engine}/generate", json=body).json()
    for k, chunk in enumerate(chunks, start=1):
        assert chunk["output_ids"] == full["output_ids"][:k]  # cumulative ids
        assert full["text"].startswith(chunk["text"])  # cumulative text
        assert len(chunk["meta_info"]["output_token_logprobs"]) == k
        assert chunk["meta_info"]["completion_tokens"] == k
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chunks[-1]["text"] == full["text"]
    assert (
        chunks[-1]["meta_info"]["output_token_logprobs"]
        == full["meta_info"]["output_token_logprobs"]
    )


def test_stream_interval_sends_a_chunk_every_k_tokens_and_the_final_one(shared_live_engine):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "stream_interval": 3,
        },
    }
    chunks = events(shared_live_engine, body)[:-1]
    # tokens 3 and 6, then the final chunk at 7 (7 is not a multiple of 3 but always comes)
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [3, 6, 7]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


def test_batch_stream_chunks_carry_their_index(shared_live_engine):
    body = {
        "input_ids": [PROMPT, PROMPT[:2]],
        "sampling_params": [
            {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        ],
    }
    chunks = events(shared_live_engine, body)[:-1]
    by_index = {0: [], 1: []}
    for c in chunks:
        by_index[c["index"]].append(c)
    assert [len(v) for v in by_index.values()] == [2, 3]
    assert by_index[1][-1]["meta_info"]["finish_reason"]["length"] == 3


def start(url: str, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box["r"] = httpx.post(f"{url}/generate", json=body, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t, box


def long_body(rid: str, tokens: int = 400) -> dict:
    return {
        "input_ids": PROMPT,
        "rid": rid,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }


def wait_running(url: str) -> None:
    time.sleep(0.3)  # let the row be prefilled and decode a few steps


def test_abort_request_matches_rid_prefixes_and_returns_partial_output(shared_live_engine):
    url = shared_live_engine
    t, box = start(
        url,
        {
            "input_ids": [PROMPT, PROMPT],
            "rid": "abortme",
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        },
    )
    wait_running(url)
    other_t, other = start(url, {**long_body("keep-1", 20)})
    r = httpx.post(f"{url}/abort_request", json={"rid": "abortme"})  # hits abortme_0, abortme_1
    assert r.status_code == 200 and r.content == b""
    t.join(60)
    other_t.join(60)
    out = box["r"].json()
    assert box["r"].status_code == 200 and [o["meta_info"]["id"] for o in out] == [
        "abortme_0",
        "abortme_1",
    ]
    for o in out:
        assert o["meta_info"]["finish_reason"]["type"] == "abort"
        assert o["meta_info"]["finish_reason"]["message"]
        assert 0 < len(o["output_ids"]) < 400  # partial output kept
        assert o["meta_info"]["completion_tokens"] == len(o["output_ids"])
    assert other["r"].json()["meta_info"]["finish_reason"]["type"] == "length"  # untouched


def test_pause_abort_then_requests_wait_until_continue(shared_live_engine):
    url = shared_live_engine
    t, box = start(url, long_body("pa-1"))
    wait_running(url)
    waiting_t, waiting = None, {}
    try:
        r = httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=60)
        assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
        t.join(60)
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert httpx.get(f"{url}/ready").status_code == 503
        waiting_t, waiting = start(url, long_body("pa-2", 3))
        time.sleep(0.5)
        assert "r" not in waiting  # accepted, held while paused
    finally:  # never leave the shared engine paused for the tests after this one
        httpx.post(f"{url}/continue_generation", json={})
    waiting_t.join(60)
    assert waiting["r"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_pause_in_place_freezes_and_continue_completes(shared_live_engine):
    url = shared_live_engine
    # Nearly the whole 512-token window: the tiny model decodes 150 tokens in well under a
    # second on a quiet machine, before the pause could land.
    t, box = start(url, long_body("pi-1", 480))
    wait_running(url)
    try:
        httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=60)
        time.sleep(0.5)
        assert "r" not in box  # frozen, not aborted
    finally:  # never leave the shared engine paused for the tests after this one
        httpx.post(f"{url}/continue_generation", json={})
    t.join(60)
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 480}
    assert "weight_versions" not in meta  # no swap happened while paused
