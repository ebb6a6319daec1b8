"""Teacher logprobs by prefill on a real engine process equal a direct transformers forward pass.

The engine serves the real SmolLM2-135M-Instruct; the reference is the same checkpoint loaded in
this process with transformers, fp32, one unpadded sequence: log_softmax(logits[t - 1])[ids[t]]
for every response position t, the first response token included (its logit row is the last
prompt position: the off-by-one that `logprob_start_len = len(prompt) - 1` exists for).

Tolerance: 2e-4 nats absolute. Both sides are fp32 on the same CPU; the engine batches requests
with left padding, which changes the reduction order of the attention (measured max differences
are about 1e-5, docs/conventions.md#machine-notes).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flywheel.teacher.context import TeacherRenderer
from flywheel.teacher.scoring import TeacherScorer

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOL = 2e-4


@pytest.fixture(scope="module")
def engine_url(smollm2_dir):
    with engine_process(smollm2_dir, "--weight-version", "7", threads="2") as url:
        yield url


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()

    def logprobs(prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt_ids + response_ids])  # (1, P + R)
        with torch.no_grad():
            logits = model(ids).logits[0].float()  # (P + R, V)
        lp = torch.log_softmax(logits, dim=-1)
        p = len(prompt_ids)
        rows = lp[p - 1 : p - 1 + len(response_ids)]  # (R, V): row t-1 scores token t
        return rows  # full distributions, for top-k checks too

    return logprobs


def _case(renderer: TeacherRenderer, question: str, answer_pieces: list[str]):
    tok = renderer.tokenizer
    prompt = renderer.prompt_ids([{"role": "user", "content": question}])
    # The student's sampled ids: pieces encoded one by one, so the sequence is NOT the canonical
    # tokenization of its text; re-tokenizing the text would score other ids.
    response = [i for piece in answer_pieces for i in tok.encode(piece, add_special_tokens=False)]
    response.append(tok.convert_tokens_to_ids("<|im_end|>"))
    return prompt, response


def test_prefill_logprobs_equal_a_forward_pass(engine_url, smollm2_dir, reference):
    renderer = TeacherRenderer(smollm2_dir)
    cases = [
        _case(renderer, "What is 2+3?", ["2 + 3", " = 5", "."]),
        _case(renderer, "Name a colour.", ["Bl", "ue"]),
        _case(renderer, "Say hello to the whole wide world, politely.", ["Hello", ", world!"]),
    ]
    text = renderer.tokenizer.decode(cases[1][1][:-1])
    assert renderer.tokenizer.encode(text, add_special_tokens=False) != cases[1][1][:-1]
    scorer = TeacherScorer([engine_url], max_batch=8, batch_wait_ms=50)
    try:
        # Concurrent requests are coalesced into one left-padded batch on the engine.
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda c: scorer.score(c[0], c[1], top_k=4), cases))
        alone = scorer.score(*cases[0])
    finally:
        scorer.close()
    for (prompt, response), scored in zip(cases, results, strict=True):
        ref_RV = reference(prompt, response)  # (R, V)
        ref_R = ref_RV.gather(1, torch.tensor(response)[:, None])[:, 0]
        got = torch.tensor(scored.logprobs, dtype=torch.float32)
        assert got.shape == ref_R.shape
        torch.testing.assert_close(got, ref_R, atol=TOL, rtol=0)
        # The first response token's logprob is real (not the null row) and matches.
        assert abs(scored.logprobs[0] - float(ref_R[0])) < TOL
        top_ref = torch.topk(ref_RV, 4, dim=-1)
        assert scored.topk_ids == top_ref.indices.tolist()
        torch.testing.assert_close(
            torch.tensor(scored.topk_logprobs), top_ref.values, atol=TOL, rtol=0
        )
        assert scored.weight_version == "7"
    # One by one gives the same numbers as batched.
    torch.testing.assert_close(
        torch.tensor(alone.logprobs), torch.tensor(results[0].logprobs), atol=TOL, rtol=0
    )
