"""Worked examples for ppo_clip and the loss aggregations (BUG-14 arithmetic)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    PPOClipConfig,
    gspo,
    normalizer_for,
    ppo_clip,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_mean,
)


def masked_mean(stat: torch.Tensor, mask: torch.Tensor) -> float:
    return float(stat[mask.bool()].mean())


def five_tokens():
    # token:          t0          t1          t2           t3          t4
    # ratio:          1.5         0.5         1.1          0.5         5.0
    # advantage:      +1          -1          +2           +1          -1
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5, 5.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -4.0]])
    new = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0, -1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    return LossInputs(new, old, adv, mask)


def test_registries():
    assert set(POLICY_LOSSES) == {
        "ppo_clip",
        "gspo",
        "cispo",
        "dhpo",
        "aspo",
        "cppo",
        "prefix_ratio",
        "wapo",
        "seq_elbo_ratio",
    }
    assert set(AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "constant_normalizer",
    }


def test_ppo_clip_worked_example_both_sides():
    inputs = five_tokens()
    out = ppo_clip(inputs, PPOClipConfig(eps_low=0.2, eps_high=0.2))
    # t0: max(-1*1.5, -1*clip(1.5)=-1.2)           = -1.2  (clipped above, A > 0)
    # t1: max(+1*0.5,  +1*clip(0.5)=0.8)           =  0.8  (clipped below, A < 0)
    # t2: max(-2*1.1, -2*1.1)                       = -2.2  (inside the band)
    # t3: max(-1*0.5, -1*clip(0.5)=-0.8)           = -0.5  (below band, A > 0: not clipped)
    # t4: max(+1*5.0, +1*1.2)                       =  5.0  (no dual clip)
    assert_close(out.token_loss_BT, torch.tensor([[-1.2, 0.8, -2.2, -0.5, 5.0]]))
    stats, mask = out.token_stats, inputs.loss_mask_BT
    assert masked_mean(stats["clip/frac"], mask) == pytest.approx(2 / 5)  # t0, t1
    assert masked_mean(stats["clip/frac_high"], mask) == pytest.approx(1 / 5)
    assert masked_mean(stats["clip/frac_low"], mask) == pytest.approx(1 / 5)
    assert masked_mean(stats["ratio/mean"], mask) == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 5) / 5)
    assert float(stats["ratio/max"].max()) == pytest.approx(5.0)
    # k3 = (r - 1) - log r; for r = 1.5: 0.5 - 0.405465 = 0.094535
    assert float(stats["kl/k3_rollout"][0, 0]) == pytest.approx(0.5 - math.log(1.5), abs=1e-6)

    # gradients d loss / d logp = -A * r where the unclipped branch is active, else 0
    out.token_loss_BT.sum().backward()
    expected_grad = torch.tensor([[0.0, 0.0, -2.0 * 1.1, -1.0 * 0.5, 1.0 * 5.0]])
    assert_close(inputs.logprobs_BT.grad, expected_grad)


def test_ppo_clip_higher_is_asymmetric():
    inputs = five_tokens()
    out = ppo_clip(inputs, PPOClipConfig(eps_low=0.2, eps_high=0.28))
    # t0: ratio 1.5 is now clipped at 1.28: max(-1.5, -1.28) = -1.28; t1 still at 0.8
    assert float(out.token_loss_BT.detach()[0, 0]) == pytest.approx(-1.28)
    assert float(out.token_loss_BT.detach()[0, 1]) == pytest.approx(0.8)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    inputs = five_tokens()
    out = ppo_clip(inputs, PPOClipConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0))
    # t4: A = -1, ratio 5: max(5.0, 1.2) = 5.0, then min(5.0, -A * c = 3.0) = 3.0
    # t1: A = -1, ratio 0.5: 0.8 < 3.0, unchanged; A > 0 tokens are never dual-clipped
    assert_close(out.token_loss_BT, torch.tensor([[-1.2, 0.8, -2.2, -0.5, 3.0]]))
    assert masked_mean(out.token_stats["clip/frac_dual"], inputs.loss_mask_BT) == pytest.approx(0.2)
    out.token_loss_BT.sum().backward()
    assert float(inputs.logprobs_BT.grad[0, 4]) == 0.0  # capped: constant in logp


def test_ppo_clip_masked_positions_are_exact_zeros_even_with_nan():
    new = torch.tensor([[-1.0, float("nan"), -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0, -1.0]])
    adv = torch.tensor([[1.0, float("nan"), 1.0]])
    mask = torch.tensor([[True, False, True]])
    out = ppo_clip(LossInputs(new, old, adv, mask), PPOClipConfig())
    # ratio 1 on t0, t2: loss = -A * 1 = -1; t1 masked -> 0, not NaN
    assert_close(out.token_loss_BT, torch.tensor([[-1.0, 0.0, -1.0]]))
    loss = token_mean(out.token_loss_BT, mask, normalizer_for(mask))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0)
    assert torch.isfinite(new.grad[mask]).all()


def test_bug14_token_mean_uses_the_global_token_count():
    # micro-batch 1: token losses [1, 1] (2 tokens); micro-batch 2: [0]*6 (6 tokens)
    # correct token mean = (2 + 0) / 8 = 0.25; the per-micro-batch-mean bug gives 0.5
    loss_BT = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [0.0] * 6])
    mask_BT = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6], dtype=torch.bool)
    norm = normalizer_for(mask_BT)
    assert (norm.tokens, norm.sequences) == (8.0, 2.0)
    whole = token_mean(loss_BT, mask_BT, norm)
    parts = token_mean(loss_BT[:1], mask_BT[:1], norm) + token_mean(loss_BT[1:], mask_BT[1:], norm)
    assert float(whole) == pytest.approx(0.25)
    assert float(parts) == pytest.approx(0.25)


def test_seq_mean_aggregations_worked_example():
    # seq A: [1, 1] -> token mean 1, token sum 2; seq B: [0]*6 -> 0, 0; seq C: no loss tokens
    loss_BT = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [0.0] * 6, [9.0] * 6])
    mask_BT = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6, [0] * 6], dtype=torch.bool)
    norm = normalizer_for(mask_BT)  # 8 tokens, 2 trainable sequences (C not counted)
    assert float(seq_mean_token_mean(loss_BT, mask_BT, norm)) == pytest.approx((1 + 0) / 2)
    assert float(seq_mean_token_sum(loss_BT, mask_BT, norm)) == pytest.approx((2 + 0) / 2)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_all_masked_micro_batch_contributes_exact_zero(name):
    global_mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    norm = normalizer_for(global_mask)
    loss_BT = torch.full((1, 3), float("nan"), requires_grad=True)
    empty = AGGREGATIONS[name](loss_BT, global_mask[1:], norm)
    empty.backward()
    assert float(empty.detach()) == 0.0
    assert torch.equal(loss_BT.grad, torch.zeros(1, 3))


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_all_masked_step_batch_gives_zero_not_nan(name):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    norm = normalizer_for(mask)  # clamped to 1 token, 1 sequence
    assert float(AGGREGATIONS[name](torch.ones(2, 3), mask, norm)) == 0.0


def two_sequences():
    # seq 0: token log ratios [0.2, -0.1, 0.5], all trained, A = +1
    #        log s = (0.2 - 0.1 + 0.5) / 3 = 0.2 -> s = e^0.2 = 1.221403
    # seq 1: token log ratios [0.1, -0.1, (5.0 masked, logp NaN)], A = -1
    #        log s = (0.1 - 0.1) / 2 = 0 -> s = 1 (the masked token enters neither sum nor length)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, -2.0]])
    diff = torch.tensor([[0.2, -0.1, 0.5], [0.1, -0.1, 0.0]])
    new = (old + diff).clone()
    new[1, 2] = float("nan")
    new.requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return LossInputs(new, old, adv, mask)


def test_gspo_worked_example_clipped_sequence():
    inputs = two_sequences()
    out = gspo(inputs, PPOClipConfig(eps_low=0.2, eps_high=0.2))
    # seq 0: max(-1 * 1.221403, -1 * clip(1.221403, 0.8, 1.2) = -1.2) = -1.2 on every token
    # seq 1: max(+1 * 1, +1 * 1) = 1.0 on its two trained tokens; the masked token: 0
    assert_close(out.token_loss_BT, torch.tensor([[-1.2, -1.2, -1.2], [1.0, 1.0, 0.0]]))
    frac_high = masked_mean(out.token_stats["clip/frac_high"], inputs.loss_mask_BT)
    assert frac_high == pytest.approx(3 / 5)
    out.token_loss_BT.sum().backward()
    # seq 0 clipped: gradient 0; seq 1: d(-A s_bt)/d logp_bt = -A * s = +1 per trained token
    assert_close(inputs.logprobs_BT.grad, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_gspo_worked_example_unclipped_sequence():
    inputs = two_sequences()
    out = gspo(inputs, PPOClipConfig(eps_low=0.2, eps_high=0.3))
    # seq 0: s = 1.221403 < 1.3: loss -A s = -1.221403 per token, gradient -A s = -1.221403
    s = math.exp(0.2)
    assert_close(out.token_loss_BT[0], torch.full((3,), -s))
    out.token_loss_BT.sum().backward()
    assert_close(inputs.logprobs_BT.grad[0], torch.full((3,), -s))


@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_ppo_clip_when_token_ratios_are_equal(seed):
    # every token of a sequence has the same ratio r_b: s_b = r_b, so values and grads match
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(3, 5, generator=gen)
    log_r = (torch.randn(3, 1, generator=gen) * 0.3).expand(3, 5)
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.2
    cfg = PPOClipConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    results = []
    for fn in (gspo, ppo_clip):
        new = (old + log_r).clone().requires_grad_(True)
        out = fn(LossInputs(new, old, adv, mask), cfg)
        out.token_loss_BT.sum().backward()
        results.append((out.token_loss_BT.detach(), new.grad))
    assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5)


def test_gspo_with_seq_mean_token_mean_equals_the_sequence_objective():
    # reference: J = 1/G sum_b max(-A_b s_b, -A_b clip(s_b)), s_b = exp(mean_t(logp - old))
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 6, generator=gen)
    diff = torch.randn(4, 6, generator=gen) * 0.2
    adv_B = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    cfg = PPOClipConfig(eps_low=0.05, eps_high=0.08)

    new_ref = (old + diff).clone().requires_grad_(True)
    log_s = torch.stack([(new_ref[b] - old[b])[mask[b]].mean() for b in range(4)])
    s = log_s.exp()
    ref = torch.maximum(-adv_B * s, -adv_B * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)).mean()
    ref.backward()

    new = (old + diff).clone().requires_grad_(True)
    out = gspo(LossInputs(new, old, adv_B[:, None].expand(4, 6), mask), cfg)
    loss = seq_mean_token_mean(out.token_loss_BT, mask, normalizer_for(mask))
    loss.backward()
    assert_close(loss.detach(), ref.detach())
    assert_close(new.grad, new_ref.grad)


def test_gspo_sequence_without_loss_tokens_is_exact_zero():
    new = torch.full((1, 3), float("nan"), requires_grad=True)
    no_tokens = torch.zeros(1, 3, dtype=torch.bool)
    out = gspo(LossInputs(new, torch.zeros(1, 3), torch.ones(1, 3), no_tokens), PPOClipConfig())
    assert torch.equal(out.token_loss_BT.detach(), torch.zeros(1, 3))
    out.token_loss_BT.sum().backward()
    assert torch.equal(new.grad, torch.zeros(1, 3))
