"""A weight push while eight streams generate on the real engine (SmolLM2-135M-Instruct).

The push (`/update_weights_from_disk`, the default `engine.weight_swap = "step"`) lands between
two decode steps: every row completes, no row waits for another to finish (the update answers,
and a short request sent after it is served, while all eight long rows are still streaming),
and each row's `meta_info.weight_versions` splits its tokens at the swap. The new checkpoint
scales only the final norm (cached keys/values stay valid), so every token's logprob must equal
a plain forward pass of the weights its span names.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ..engine_process import engine_process

pytestmark = pytest.mark.integration

ROWS = 8
NEW_TOKENS = 96
PROMPT = "Tell me a long story about a lighthouse keeper."


def stream(url: str, seed: int, new_tokens: int, log: list, box: dict) -> None:
    """One streamed /generate row; appends (time, completion_tokens) per chunk to `log`."""
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunk = json.loads(line[5:])
                log.append((time.monotonic(), chunk["meta_info"]["completion_tokens"]))
                box["last"] = chunk
    box["done_at"] = time.monotonic()


def test_push_while_eight_streams_generate(smollm2_dir, tmp_path):
    state = load_file(smollm2_dir / "model.safetensors")
    new_state = {**state, "model.norm.weight": state["model.norm.weight"] * 1.25}
    (tmp_path / "v1").mkdir()
    save_file(new_state, tmp_path / "v1" / "model.safetensors")
    with engine_process(smollm2_dir, threads="2", max_batch_size="16") as url:
        logs: list[list] = [[] for _ in range(ROWS)]
        boxes: list[dict] = [{} for _ in range(ROWS)]
        rows = [
            threading.Thread(target=stream, args=(url, i, NEW_TOKENS, logs[i], boxes[i]))
            for i in range(ROWS)
        ]
        for t in rows:
            t.start()
        deadline = time.monotonic() + 120
        while min((lg[-1][1] if lg else 0) for lg in logs) < 10:  # every row is decoding
            assert time.monotonic() < deadline
            time.sleep(0.02)
        tokens_before = [lg[-1][1] for lg in logs]  # tokens each row had streamed by then
        r = httpx.post(
            f"{url}/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v1"), "weight_version": "v1"},
            timeout=120,
        )
        answered_at = time.monotonic()
        assert r.status_code == 200 and r.json()["success"], r.text
        short: dict = {}
        stream(url, 99, 2, [], short)
        for t in rows:
            t.join(300)
    # ordering: the update and a request after it were answered while every row still ran
    assert all(answered_at < b["done_at"] for b in boxes)
    assert all(short["done_at"] < b["done_at"] for b in boxes)
    assert short["last"]["meta_info"]["weight_version"] == "v1"
    models = {}
    for name, weights in (("default", None), ("v1", new_state)):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
        if weights is not None:
            model.load_state_dict(weights, strict=False)
        models[name] = model.eval()
    prompt_ids = None
    for i, (lg, box) in enumerate(zip(logs, boxes, strict=True)):
        meta = box["last"]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": NEW_TOKENS}, i
        (old, new) = meta["weight_versions"]
        k = old["end"]
        assert (old["version"], old["start"], new["version"], new["start"], new["end"]) == (
            "default",
            0,
            "v1",
            k,
            NEW_TOKENS,
        )
        # the swap came after the tokens streamed before the update was sent, and before
        # every chunk that arrived after it answered; the row kept streaming after the swap
        assert tokens_before[i] <= k < NEW_TOKENS
        assert all(n >= k for t, n in lg if t > answered_at)
        assert any(t > answered_at for t, _ in lg)
        # each span's logprobs are its own weights' (a full forward pass, 1e-3 nats)
        out = [row[1] for row in meta["output_token_logprobs"]]
        got = torch.tensor([row[0] for row in meta["output_token_logprobs"]])
        if prompt_ids is None:
            prompt_ids = [row[1] for row in meta["input_token_logprobs"]]
        full = torch.tensor([prompt_ids + out])
        for name, lo, hi in (("default", 0, k), ("v1", k, NEW_TOKENS)):
            with torch.inference_mode():
                logits = models[name](input_ids=full).logits[0]  # (T, V)
            lp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
            ref = lp.gather(1, torch.tensor(out)[:, None])[:, 0]
            torch.testing.assert_close(got[lo:hi], ref[lo:hi], atol=1e-3, rtol=0)
