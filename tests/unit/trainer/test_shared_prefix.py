"""Shared-prefix micro-batches (`trainer.batch.layout = "shared_prefix"`) against the padded
path: same logprobs, loss and gradients on the real tiny model, and each shared prompt run once."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer import shared_prefix_packed
from flywheel.trainer.logprobs import selected_token_logprobs
from flywheel.trainer.shared_prefix import length_buckets, prefix_clusters
from flywheel.trainer.shared_prefix_packed import packed_segments
from flywheel.trainer.step import prepare_batch
from flywheel.trainer.weights import load_model

from .factories import make_sample, step_config
from .step_checks import assert_same_step

GROUPS = [(20, [5, 9, 2]), (30, [7, 1, 12])]
"""(prompt tokens, completion tokens of each member) of two groups sharing their prompts."""


def samples():
    out = []
    for g, (prompt_len, completions) in enumerate(GROUPS):
        prompt = torch.randint(1, 40000, (prompt_len,), generator=torch.Generator().manual_seed(g))
        for i, completion_len in enumerate(completions):
            sample = make_sample(
                prompt_len=prompt_len,
                completion_len=completion_len,
                reward=float(i % 2),
                seed=10 * g + i,
                temperature=0.8 + 0.1 * i,
                logprob=-0.4 - 0.1 * i,
                group_id=f"g{g}",
            )
            sample.token_ids[:prompt_len] = prompt.tolist()
            out.append(sample)
    # a row sharing no prompt with any other: runs in the plain padded pass
    out.append(make_sample(prompt_len=6, completion_len=4, seed=99, group_id="g1", reward=1.0))
    return [out]


@pytest.fixture
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_prefix_clusters_worked_example():
    # row 1 shares 3 tokens with row 0, row 3 shares 2; row 2 shares none. The cluster's prefix
    # is the common one of all three (2), within the shortest row's length - 1 (3 - 1 = 2).
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [1, 2, 9]]
    assert prefix_clusters(rows, min_prefix=2) == ([([0, 1, 3], 2)], [2])
    # capped at the shortest row's length - 1: [1, 2] keeps one token of its own
    assert prefix_clusters([[1, 2, 3], [1, 2]], min_prefix=1) == ([([0, 1], 1)], [])
    # below min_prefix, or alone: the plain pass
    assert prefix_clusters([[1, 2, 3], [1, 2, 4]], min_prefix=3) == ([], [0, 1])


def logprobs(model, batch, shared_prefix: bool):
    with torch.no_grad():
        return selected_token_logprobs(
            model,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.temperature_B,
            batch.loss_mask_BT,
            shared_prefix=shared_prefix,
        )


def test_shared_prefix_logprobs_equal_padded_ones(tiny, path):
    batch, _ = prepare_batch(samples(), step_config(batch={"layout": "padded"}))
    padded = logprobs(tiny, batch, shared_prefix=False)
    shared = logprobs(tiny, batch, shared_prefix=True)
    assert int(batch.loss_mask_BT.sum()) == 5 + 9 + 2 + 7 + 1 + 12 + 4
    assert_close(shared.logprobs_BT, padded.logprobs_BT, atol=2e-5, rtol=1e-5)
    assert_close(shared.entropy_BT, padded.entropy_BT, atol=2e-5, rtol=1e-5)


@pytest.fixture(params=["one_pass", "cache"])
def path(request, monkeypatch):
    """Both shared-prefix paths: one packed pass (micro-batches up to PACKED_MAX_TOKENS), and
    the prompt's key/value cache (larger ones)."""
    if request.param == "cache":
        monkeypatch.setattr(shared_prefix_packed, "PACKED_MAX_TOKENS", 0)
    return request.param


def count_positions(model, run):
    """Decoder positions of each decoder call made by `run()`."""
    positions: list[int] = []

    def count(_module, _args, kwargs):
        positions.append(int(kwargs["inputs_embeds"].shape[:2].numel()))

    handle = model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return positions


def test_shared_prefix_runs_each_prompt_once(tiny, path):
    # 7 rows in one micro-batch. Padded: 7 x 42 = 294 decoder positions (the longest row is
    # 30 + 12). One pass: prompt 20 + suffixes 5 + 9 + 2, prompt 30 + 7 + 1 + 12, the lone
    # row 10: 96 positions. On the cache: group 0 runs its prompt (20) + 3 x 9 suffix positions
    # (its longest), group 1 runs 30 + 3 x 12, the lone row 10: 20 + 27 + 30 + 36 + 10 = 123.
    batch, _ = prepare_batch(samples(), step_config(batch={"layout": "padded"}))
    shared = count_positions(tiny, lambda: logprobs(tiny, batch, shared_prefix=True))
    assert shared == ([96] if path == "one_pass" else [20, 27, 30, 36, 10])
    assert count_positions(tiny, lambda: logprobs(tiny, batch, shared_prefix=False)) == [7 * 42]


def test_packed_segments_worked_example():
    ids, positions, segments, sees, sources = packed_segments(
        [[1, 2, 3], [1, 2, 4, 5], [7]], min_prefix=2
    )
    assert ids == [1, 2, 3, 4, 5, 7]
    assert positions == [0, 1, 2, 2, 3, 0]
    assert segments == [0, 0, 1, 2, 2, 3]
    assert sees == [-1, -1, 0, 0, 0, -1]
    assert sources == [[0, 1, 2], [0, 1, 3, 4], [5]]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_shared_prefix_step_has_the_padded_loss_and_gradients(tiny_model_dir, aggregation, path):
    padded_cfg = step_config(
        algorithm={"loss_aggregation": aggregation},
        batch={"micro_batch_size": 7, "layout": "padded"},
    )
    shared_cfg = step_config(padded_cfg, batch={"layout": "shared_prefix"})
    assert_same_step(tiny_model_dir, samples(), padded_cfg, shared_cfg)


def test_a_layout_is_one_of_them(tiny):
    ids = torch.tensor([[5, 6, 7]])
    score = torch.tensor([[False, True, True]])
    with pytest.raises(ValueError, match="one layout"):
        selected_token_logprobs(
            tiny, ids, torch.ones_like(ids), torch.ones(1), score, packed=True, shared_prefix=True
        )
    with pytest.raises(ValueError, match="right-padded"):
        selected_token_logprobs(
            tiny, ids, torch.tensor([[0, 1, 1]]), torch.ones(1), score, shared_prefix=True
        )


def test_length_buckets_worked_example():
    # overhead 16, suffix lengths (30, 2, 3, 2): one pass costs 4 x 30 + 16 = 136; (2, 2, 3) +
    # (30) cost 3 x 3 + 16 + 30 + 16 = 71; (2, 2) + (3) + (30) cost 4 + 16 + 3 + 16 + 46 = 85
    assert length_buckets([30, 2, 3, 2], overhead=16) == [[1, 3, 2], [0]]
    # (5, 9, 2): one pass 3 x 9 + 16 = 43 beats (2, 5) + (9) = 10 + 16 + 9 + 16 = 51
    assert length_buckets([5, 9, 2], overhead=16) == [[2, 0, 1]]
    # no overhead: every distinct length its own pass
    assert length_buckets([4, 1, 4], overhead=0) == [[1], [0, 2]]
    assert length_buckets([], overhead=16) == []


def long_tail_group():
    prompt = torch.randint(1, 40000, (20,), generator=torch.Generator().manual_seed(5))
    out = []
    for i, completion_len in enumerate([2, 30, 3, 2]):
        sample = make_sample(
            prompt_len=20,
            completion_len=completion_len,
            reward=float(i % 2),
            seed=50 + i,
            temperature=0.9,
            group_id="g",
        )
        sample.token_ids[:20] = prompt.tolist()
        out.append(sample)
    return [out]


def test_one_long_reply_does_not_pad_the_short_ones(tiny, path):
    # prompt 20, suffixes (2, 30, 3, 2). On the cache: the prompt once, then (2, 2, 3) in one
    # pass of 3 x 3 positions and (30) alone: 20 + 9 + 30 = 59 decoder positions, where one
    # suffix pass would run 20 + 4 x 30 = 140. One pass: 20 + 2 + 30 + 3 + 2 = 57, no padding.
    # Either way the logprobs are the padded pass's.
    batch, _ = prepare_batch(long_tail_group(), step_config(batch={"layout": "padded"}))
    out = []
    positions = count_positions(tiny, lambda: out.append(logprobs(tiny, batch, shared_prefix=True)))
    assert positions == ([57] if path == "one_pass" else [20, 9, 30])
    padded = logprobs(tiny, batch, shared_prefix=False)
    assert_close(out[0].logprobs_BT, padded.logprobs_BT, atol=2e-5, rtol=1e-5)
    assert_close(out[0].entropy_BT, padded.entropy_BT, atol=2e-5, rtol=1e-5)


def test_long_tail_step_has_the_padded_loss_and_gradients(tiny_model_dir, path):
    padded_cfg = step_config(batch={"micro_batch_size": 4, "layout": "padded"})
    shared_cfg = step_config(padded_cfg, batch={"layout": "shared_prefix"})
    assert_same_step(tiny_model_dir, long_tail_group(), padded_cfg, shared_cfg)
