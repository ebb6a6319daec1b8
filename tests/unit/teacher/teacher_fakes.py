"""Fakes and Sample builders shared by the teacher unit tests."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

from flywheel.core.codec import new_sample
from flywheel.teacher.scoring import ScoredTokens


class FakeScorer:
    """Teacher logprob of response token i = -0.1 * (i + 1) + offset(prompt ids) (offset 0 by
    default); top-k ids 10+j, logprob -j."""

    def __init__(self, fail: Exception | None = None, offset=lambda prompt_ids: 0.0):
        self.calls: list[tuple[list[int], list[int], int]] = []
        self.fail = fail
        self.offset = offset
        self.lock = threading.Lock()

    def submit(self, prompt_ids, response_ids, top_k=0) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.score(prompt_ids, response_ids, top_k))
        except Exception as exc:  # noqa: BLE001  (delivered through the Future, like the real one)
            future.set_exception(exc)
        return future

    def score(self, prompt_ids, response_ids, top_k=0):
        with self.lock:
            self.calls.append((prompt_ids, response_ids, top_k))
        if self.fail:
            raise self.fail
        n = len(response_ids)
        return ScoredTokens(
            [-0.1 * (i + 1) + self.offset(prompt_ids) for i in range(n)],
            [[10 + j for j in range(top_k)] for _ in range(n)],
            [[-float(j) for j in range(top_k)] for _ in range(n)],
            "5",
            "u",
        )


def live_sample(renderer, temperature=1.0, task=None, segments=1):
    """A turn: prompt ids (mask 0) + sampled ids (mask 1, rollout logprob -0.5 each)."""
    tok = renderer.tokenizer
    msgs = [{"role": "user", "content": "What is 7 + 1?"}]
    ids, mask = renderer.prompt_ids(msgs), []
    mask = [0] * len(ids)
    for k in range(segments):
        reply = tok.encode(f"It is {9 + k}.", add_special_tokens=False) + [2]
        ids += reply
        mask += [1] * len(reply)
        msgs.append({"role": "assistant", "content": f"It is {9 + k}."})
        if k < segments - 1:
            follow = tok.encode(
                "\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False,
            )
            ids += follow
            mask += [0] * len(follow)
            msgs.append({"role": "user", "content": "Again?"})
    sample = new_sample(
        session_id="s",
        mode="live",
        token_ids=ids,
        loss_mask=mask,
        rollout_logprobs=[-0.5 * m for m in mask],
        weight_versions=[0 if m else -1 for m in mask],
        task_json=json.dumps(task or {}),
    )
    sample.sampling.temperature = temperature
    for m in msgs:
        sample.messages.add(role=m["role"], content_json=json.dumps(m["content"]))
    sample.next_state.role = "user"
    sample.next_state.content_json = json.dumps("No, it is 8.")
    return sample
