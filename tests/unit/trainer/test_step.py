"""The optimizer step: gradient accumulation equals one big batch (BUG-14), non-finite skips."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.losses import AGGREGATIONS, PPOClipConfig, normalizer_for
from flywheel.trainer.step import StepConfig, accumulate, prepare_batch, train_step

from .factories import make_sample, tiny_model

LENGTHS = [(3, 5), (6, 2), (4, 0), (2, 0), (5, 7), (3, 1), (7, 4), (2, 3)]
"""(prompt, completion) of 8 samples; samples 2 and 3 have no loss tokens, so with micro-batches
of 2 the second micro-batch is all-masked."""


def groups_of_samples():
    samples = [
        make_sample(prompt_len=p, completion_len=c, reward=float(i % 3), logprob=-5.5 + 0.2 * i,
                    temperature=[1.0, 0.7][i % 2], seed=i, group_id=f"g{i // 4}")
        for i, (p, c) in enumerate(LENGTHS)
    ]
    return [samples[:4], samples[4:]]


def config(aggregation="token_mean", micro_batch_size=8, **kw) -> StepConfig:
    return StepConfig(
        aggregation=aggregation, micro_batch_size=micro_batch_size, logprob_chunk_tokens=4,
        clip=PPOClipConfig(0.2, 0.28, 3.0), **kw,
    )


def grads_after_accumulate(aggregation, micro_batch_size):
    model = tiny_model(seed=3)
    cfg = config(aggregation, micro_batch_size)
    batch, _ = prepare_batch(groups_of_samples(), cfg)
    acc = accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return acc, grads


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_bug14_grad_accumulation_equals_one_big_batch(aggregation):
    whole, whole_grads = grads_after_accumulate(aggregation, micro_batch_size=8)
    assert whole.micro_batches == 1
    assert whole.stats.result()["clip/frac"] > 0  # the example exercises clipping
    for micro_batch_size, n_micro, n_empty in [(4, 2, 0), (2, 4, 1)]:
        acc, grads = grads_after_accumulate(aggregation, micro_batch_size)
        assert (acc.micro_batches, acc.empty_micro_batches) == (n_micro, n_empty)
        assert acc.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
        for name, grad in grads.items():
            assert_close(grad, whole_grads[name], atol=1e-6, rtol=1e-4, msg=name)
        for name, value in acc.stats.result().items():
            assert value == pytest.approx(whole.stats.result()[name], rel=1e-5, abs=1e-6), name


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_unchanged(before, model, optimizer):
    weights, opt_state = before
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = optimizer.state_dict()["state"]
    assert after.keys() == opt_state["state"].keys()
    for key, state in after.items():
        for name, value in state.items():
            assert torch.equal(value, opt_state["state"][key][name]), (key, name)
    assert all(p.grad is None for p in model.parameters())


def trained_model_and_optimizer():
    model = tiny_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, _ = prepare_batch(groups_of_samples(), config())
    first = train_step(model, optimizer, batch, config(micro_batch_size=4))
    assert not first.skipped
    return model, optimizer, batch


def test_step_updates_weights_and_reports_metrics():
    model = tiny_model(seed=5)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, adv_metrics = prepare_batch(groups_of_samples(), config())
    result = train_step(model, optimizer, batch, config(micro_batch_size=4))
    assert result.skipped == ""
    changed = [n for n, t in model.state_dict().items() if not torch.equal(t, before[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) > 10
    for key in ["loss/pg", "reward/mean", "clip/frac", "ratio/mean", "ratio/max", "kl/k3_rollout",
                "entropy/mean", "logprob/abs_diff_mean", "grad/norm", "time/step_s",
                "tokens/trained", "samples/trained", "batch/empty_micro_batches", "step/skipped"]:
        assert key in result.metrics, key
    assert result.metrics["tokens/trained"] == sum(c for _, c in LENGTHS)
    assert result.metrics["reward/mean"] == pytest.approx(sum(i % 3 for i in range(8)) / 8)
    assert adv_metrics["adv/groups"] == 2


def test_nonfinite_loss_skips_the_step_and_leaves_everything_unchanged():
    model, optimizer, batch = trained_model_and_optimizer()
    before = snapshot(model, optimizer)
    poisoned = dataclasses.replace(
        batch, advantages_BT=torch.where(batch.loss_mask_BT, float("inf"), 0.0)
    )
    result = train_step(model, optimizer, poisoned, config(micro_batch_size=4))
    assert result.skipped == "nonfinite_loss"
    assert result.metrics["step/skipped"] == 1.0
    assert_unchanged(before, model, optimizer)


def test_nonfinite_grad_norm_skips_the_step_and_leaves_everything_unchanged():
    model, optimizer, batch = trained_model_and_optimizer()
    before = snapshot(model, optimizer)
    hook = model.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    result = train_step(model, optimizer, batch, config(micro_batch_size=4))
    hook.remove()
    assert result.skipped == "nonfinite_grad_norm"
    assert result.metrics["loss/pg"] == result.metrics["loss/pg"]  # the loss itself was finite
    assert_unchanged(before, model, optimizer)


def test_batch_without_loss_tokens_is_skipped():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = snapshot(model, optimizer)
    groups = [[make_sample(completion_len=0, seed=i) for i in range(2)]]
    batch, _ = prepare_batch(groups, config())
    result = train_step(model, optimizer, batch, config())
    assert result.skipped == "no_loss_tokens"
    assert_unchanged(before, model, optimizer)


def test_prepare_batch_spreads_group_advantages_over_loss_tokens():
    # group g0 rewards [1, 0]: grpo A = [+0.7071, -0.7071] on each sample's sampled tokens
    groups = [[make_sample(reward=1.0, seed=1), make_sample(reward=0.0, seed=2)]]
    batch, metrics = prepare_batch(groups, config())
    expected_row0 = torch.tensor([0, 0, 0, 0] + [0.707107] * 4)
    assert_close(batch.advantages_BT[0], expected_row0, atol=1e-5, rtol=0)
    assert_close(batch.advantages_BT[1], -expected_row0, atol=1e-5, rtol=0)
    assert metrics["adv/max_abs"] == pytest.approx(0.707107, abs=1e-5)
