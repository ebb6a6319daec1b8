"""Conformance of /generate with SGLang 0.5.23 (docs/engine-protocol.md).

Each test names the SGLang fact it pins. The gateway, teacher and trainer clients rely on the
same facts, so an engine that passes here can be swapped for a real SGLang server.
"""

from __future__ import annotations

import math

import pytest
import torch

from flywheel.engine.protocol import dumps

PROMPT = [1, 504, 3458, 314, 260, 1789]


def gen(client, **body):
    r = client.post("/generate", json={"input_ids": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_default_max_new_tokens_is_128(client):
    out = gen(client, sampling_params={"ignore_eos": True})  # 2.2: max_new_tokens default 128
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 128


def test_temperature_below_1e_6_is_greedy_with_raw_logprobs(client):
    greedy = gen(
        client, sampling_params={"max_new_tokens": 6, "temperature": 0}, return_logprob=True
    )
    tiny_t = gen(
        client, sampling_params={"max_new_tokens": 6, "temperature": 5e-7}, return_logprob=True
    )
    assert tiny_t["output_ids"] == greedy["output_ids"]
    # greedy rows report log_softmax(logits) (T = 1), not logits / 5e-7 (which would be ~0)
    lp_greedy = [r[0] for r in greedy["meta_info"]["output_token_logprobs"]]
    lp_tiny = [r[0] for r in tiny_t["meta_info"]["output_token_logprobs"]]
    assert lp_tiny == pytest.approx(lp_greedy, abs=1e-6)
    assert min(lp_greedy) < -1e-3


def test_output_logprobs_are_tempered_and_taken_before_top_p_top_k(client):
    """2.4: output logprob = log_softmax(logits / T) before truncation. Worked check: with the
    same seed and T, top_k=1 forces the argmax token; its reported logprob must equal the
    untruncated tempered value (< 0), not log(1) = 0 of the renormalized kept set."""
    base = {"max_new_tokens": 1, "temperature": 0.5, "sampling_seed": 4}
    forced = gen(
        client, sampling_params={**base, "top_k": 1}, return_logprob=True, top_logprobs_num=1
    )
    row = forced["meta_info"]["output_token_logprobs"][0]
    top = forced["meta_info"]["output_top_logprobs"][0][0]
    assert row[1] == top[1] and row[0] == pytest.approx(top[0])
    assert row[0] < -1e-4  # not renormalized to 0
    wide = gen(
        client, sampling_params={**base, "top_p": 0.3}, return_logprob=True, top_logprobs_num=1
    )
    assert wide["meta_info"]["output_top_logprobs"][0][0][0] == pytest.approx(top[0], abs=1e-6)


def test_stop_string_finish_shape_trim_and_no_stop_trim(client):
    probe = gen(client, sampling_params={"max_new_tokens": 8, "temperature": 0})
    text = probe["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = gen(client, sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    kept = gen(
        client,
        sampling_params={"max_new_tokens": 8, "temperature": 0, "stop": stop, "no_stop_trim": True},
    )
    assert stop in kept["text"] and kept["output_ids"] == out["output_ids"]


def test_stop_token_kept_in_output_ids_trimmed_from_text_unless_no_stop_trim(client):
    probe = gen(client, sampling_params={"max_new_tokens": 4, "temperature": 0})
    stop_id = probe["output_ids"][1]
    params = {
        "max_new_tokens": 4,
        "temperature": 0,
        "stop_token_ids": [stop_id],
        "skip_special_tokens": False,
    }
    out = gen(client, sampling_params=params)
    assert out["output_ids"][-1] == stop_id  # 2.4: output_ids include the matched stop token
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    kept = gen(client, sampling_params={**params, "no_stop_trim": True})
    assert len(kept["text"]) > len(out["text"])


def test_input_logprobs_alignment_null_first_row_and_the_off_by_one(client):
    response = [28, 29, 30]
    ids = PROMPT + response
    for start in (0, 2, len(PROMPT) - 1, len(PROMPT)):
        out = client.post(
            "/generate",
            json={
                "input_ids": ids,
                "return_logprob": True,
                "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0},
            },
        ).json()
        rows = out["meta_info"]["input_token_logprobs"]
        assert len(rows) == len(ids) - start  # 3: len == N - L
        assert rows[0][0] is None and rows[0][1] == ids[start]  # entry 0 is always null
        assert [r[1] for r in rows] == ids[start:]
    # pitfall: L = len(prompt) loses the first response token's logprob (it is the null row)
    assert rows[0][1] == response[0] and rows[0][0] is None
    full = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    ).json()["meta_info"]["input_token_logprobs"]
    assert [r[0] for r in rows[1:]] == pytest.approx([r[0] for r in full[-2:]], abs=1e-5)


def test_prompt_logprobs_are_at_temperature_one(client):
    body = {"return_logprob": True, "logprob_start_len": 0}
    t1 = gen(client, sampling_params={"max_new_tokens": 0, "temperature": 1.0}, **body)
    t3 = gen(client, sampling_params={"max_new_tokens": 0, "temperature": 3.0}, **body)
    assert t1["meta_info"]["input_token_logprobs"] == t3["meta_info"]["input_token_logprobs"]


def test_token_ids_logprob_rows(client):
    out = gen(
        client,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=len(PROMPT) - 2,
        top_logprobs_num=1,
        token_ids_logprob=[5, 28],
    )
    meta = out["meta_info"]
    assert meta["input_token_ids_logprobs"][0] is None
    assert [[r[1] for r in row] for row in meta["input_token_ids_logprobs"][1:]] == [[5, 28]]
    assert len(meta["output_token_ids_logprobs"]) == 2
    # the greedy token's own logprob equals its entry when it is among the asked ids
    first = meta["output_top_logprobs"][0][0]
    ask = gen(
        client,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        token_ids_logprob=[first[1]],
    )
    assert ask["meta_info"]["output_token_ids_logprobs"][0][0][0] == pytest.approx(first[0])


def test_n_on_a_single_prompt_is_an_array_with_suffixed_rids(client):
    out = gen(client, rid="grp", sampling_params={"max_new_tokens": 3, "n": 3, "ignore_eos": True})
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == [
        "grp_0",
        "grp_1",
        "grp_2",
    ]
    assert all(len(o["output_ids"]) == 3 for o in out)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, "rid"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"min_p": 2}}, "min_p"),
        ({"input_ids": PROMPT, "sampling_params": {"stop": ["x"] * 33}}, "stop"),
        (
            {"input_ids": PROMPT, "token_ids_logprob": [10**9], "return_logprob": True},
            "token_ids_logprob",
        ),
        ({"input_ids": [10**9]}, "vocabulary"),
    ],
)
def test_more_400s(client, body, fragment):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert fragment in str(r.json()["error"])


def test_top_level_unknown_keys_are_ignored_and_top_k_minus_one_is_all(client):
    out = gen(client, whatever=1, sampling_params={"max_new_tokens": 2, "top_k": -1})
    assert len(out["output_ids"]) <= 2


def test_non_finite_values_serialize_as_null():
    # 1: orjson writes NaN / +-inf as null; rows are 3-element arrays
    raw = dumps({"rows": [(-math.inf, 5, None), (float("nan"), 6, "x"), (-0.5, 7, None)]})
    assert raw == b'{"rows":[[null,5,null],[null,6,"x"],[-0.5,7,null]]}'
    assert dumps(torch.tensor([-math.inf]).tolist()) == b"[null]"
