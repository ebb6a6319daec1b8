"""Packed (padding-free) micro-batches against the padded path: same logprobs, loss and
gradients on the real tiny model, for samples of very different lengths."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.logprobs import selected_token_logprobs
from flywheel.trainer.step import StepConfig, prepare_batch, split_micro_batches
from flywheel.trainer.weights import load_model

from .factories import make_sample, step_config
from .step_checks import assert_same_step

LENGTHS = [(3, 2), (40, 60), (5, 9), (2, 1), (12, 30)]
"""(prompt, completion) tokens: totals 5, 100, 14, 3, 42, so padded micro-batches of 5 rows
hold 5 x 100 = 500 positions for 164 real tokens (67% padding)."""


def groups():
    samples = [
        make_sample(
            prompt_len=p,
            completion_len=c,
            reward=float(i % 2),
            seed=i,
            temperature=0.7 + 0.1 * i,
            logprob=-0.5 - 0.1 * i,
            group_id="g",
        )
        for i, (p, c) in enumerate(LENGTHS)
    ]
    return [samples]


@pytest.fixture
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_logprobs_equal_padded_ones(tiny):
    batch, _ = prepare_batch(groups(), StepConfig())
    args = (
        tiny,
        batch.input_ids_BT,
        batch.attention_mask_BT,
        batch.temperature_B,
        batch.loss_mask_BT,
    )
    with torch.no_grad():
        padded = selected_token_logprobs(*args)
        packed = selected_token_logprobs(*args, packed=True)
    assert bool(batch.loss_mask_BT.any())
    assert_close(packed.logprobs_BT, padded.logprobs_BT, atol=2e-5, rtol=1e-5)
    assert_close(packed.entropy_BT, padded.entropy_BT, atol=2e-5, rtol=1e-5)


def test_packing_without_the_block_mask_would_differ(tiny):
    # The test above can fail: one sequence over all tokens (one position run, so tokens
    # attend across sample boundaries) gives other logprobs than the packed path.
    batch, _ = prepare_batch(groups(), StepConfig())
    real_BT = batch.attention_mask_BT.bool()
    with torch.no_grad():
        packed = selected_token_logprobs(
            tiny,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.temperature_B,
            batch.loss_mask_BT,
            packed=True,
        )
        flat = tiny.base_model(input_ids=batch.input_ids_BT[real_BT][None]).last_hidden_state
        packed_hidden = tiny.base_model(
            input_ids=batch.input_ids_BT[real_BT][None],
            position_ids=(real_BT.long().cumsum(1) - 1)[real_BT][None],
        ).last_hidden_state
    assert not torch.allclose(flat, packed_hidden, atol=1e-3)
    assert bool(packed.logprobs_BT.ne(0).any())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_step_has_the_padded_loss_and_gradients(tiny_model_dir, aggregation):
    padded_cfg = step_config(
        algorithm={"loss_aggregation": aggregation},
        batch={"micro_batch_size": 5, "layout": "padded"},
    )
    packed_cfg = step_config(padded_cfg, batch={"layout": "packed"})
    assert_same_step(tiny_model_dir, groups(), padded_cfg, packed_cfg)


def test_packed_micro_batches_count_real_tokens():
    # lengths 5, 100, 14, 3, 42; size 8, budget 64 real tokens:
    # (0) then 100 alone (5 + 100 > 64), then 14 + 3 + 42 = 59 <= 64 together.
    batch, _ = prepare_batch(groups(), StepConfig())
    cfg = step_config(batch={"micro_batch_size": 8, "micro_batch_tokens": 64, "layout": "packed"})
    parts = split_micro_batches(batch, cfg)
    assert [mb.lengths_B.tolist() for mb in parts] == [[5], [100], [14, 3, 42]]
    two_rows = split_micro_batches(
        batch, step_config(cfg, batch={"micro_batch_tokens": 0, "micro_batch_size": 2})
    )
    assert [mb.size for mb in two_rows] == [2, 2, 1]


def test_packed_logprobs_refuse_left_padding(tiny):
    ids = torch.tensor([[0, 5, 6, 7]])
    attn = torch.tensor([[0, 1, 1, 1]])
    score = torch.tensor([[False, False, True, True]])
    with pytest.raises(ValueError, match="right-padded"):
        selected_token_logprobs(tiny, ids, attn, torch.ones(1), score, packed=True)
