"""Shared-prefix micro-batches (`trainer.batch.layout = "shared_prefix"`) against the padded
path: same logprobs, loss and gradients on the real tiny model, and each shared prompt run once."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.logprobs import selected_token_logprobs
from flywheel.trainer.shared_prefix import prefix_clusters
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


def test_shared_prefix_logprobs_equal_padded_ones(tiny):
    batch, _ = prepare_batch(samples(), step_config(batch={"layout": "padded"}))
    padded = logprobs(tiny, batch, shared_prefix=False)
    shared = logprobs(tiny, batch, shared_prefix=True)
    assert int(batch.loss_mask_BT.sum()) == 5 + 9 + 2 + 7 + 1 + 12 + 4
    assert_close(shared.logprobs_BT, padded.logprobs_BT, atol=2e-5, rtol=1e-5)
    assert_close(shared.entropy_BT, padded.entropy_BT, atol=2e-5, rtol=1e-5)


def test_shared_prefix_runs_each_prompt_once(tiny):
    # 7 rows in one micro-batch. Padded: 7 x 42 = 294 decoder positions (the longest row is
    # 30 + 12). Shared: group 0 runs its prompt (20) + 3 x 9 suffix positions (its longest
    # completion), group 1 runs 30 + 3 x 12, the lone row 10: 20 + 27 + 30 + 36 + 10 = 123.
    batch, _ = prepare_batch(samples(), step_config(batch={"layout": "padded"}))
    positions: list[int] = []

    def count(_module, _args, kwargs):
        positions.append(int(kwargs["input_ids"].numel()))

    handle = tiny.base_model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        logprobs(tiny, batch, shared_prefix=True)
        assert sum(positions) == 123 and len(positions) == 5
        positions.clear()
        logprobs(tiny, batch, shared_prefix=False)
        assert positions == [7 * 42]
    finally:
        handle.remove()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_shared_prefix_step_has_the_padded_loss_and_gradients(tiny_model_dir, aggregation):
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
