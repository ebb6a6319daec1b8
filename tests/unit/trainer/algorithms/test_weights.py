"""Worked examples and properties of the token weight / mask / selection parts (weights.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.weights import WEIGHTS, apply_weight

from .helpers import ctx

ENTROPY = [[0.1, 0.5, 0.9, 0.3, 0.7, 9.0]]
"""Five loss tokens and one padding position with a huge entropy that must never be picked."""
MASK = [[1, 1, 1, 1, 1, 0]]
ADV = [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def test_high_entropy_only_worked_example():
    # loss-token entropies sorted: 0.1 0.3 0.5 0.7 0.9; q = 0.4 -> tau = Quantile_0.6:
    # position 0.6 * 4 = 2.4 -> 0.5 + 0.4 * (0.7 - 0.5) = 0.58: keeps 0.9 and 0.7 only
    out = apply_weight("high_entropy_only", ctx(ADV, MASK, entropy=ENTROPY), {"top_frac": 0.4})
    assert_close(out.advantages_BT, torch.tensor([[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]]))
    assert out.metrics["weight/high_entropy_only/threshold"] == pytest.approx(0.58)
    assert out.metrics["weight/high_entropy_only/kept_frac"] == pytest.approx(0.4)


def test_high_entropy_only_with_all_tokens_is_grpo_and_padding_stays_zero():
    out = apply_weight("high_entropy_only", ctx(ADV, MASK, entropy=ENTROPY), {"top_frac": 1.0})
    assert_close(out.advantages_BT, torch.tensor(ADV))


def test_entropy_gate_worked_example():
    # same tau as above (top 40% by entropy): 0.9 and 0.7 full, the rest x 0.1
    out = apply_weight(
        "entropy_gate", ctx(ADV, MASK, entropy=ENTROPY), {"high_frac": 0.4, "low_weight": 0.1}
    )
    assert_close(out.advantages_BT, torch.tensor([[0.1, 0.1, 1.0, 0.1, 1.0, 0.0]]))
    unchanged = apply_weight("entropy_gate", ctx(ADV, MASK, entropy=ENTROPY), {"low_weight": 1.0})
    assert_close(unchanged.advantages_BT, torch.tensor(ADV))


def test_entropy_weighted_gtpo_worked_example():
    # positive row H = [0.5, 1.5]: mean_+ H = 1.0 -> w = 1 + H / 1 = [1.5, 2.5]
    # negative row H = [0.5, 2.0]: 1/H = [2, 0.5], mean 1.25 -> w = 1 + [1.6, 0.4] = [2.6, 1.4]
    out = apply_weight(
        "entropy_weighted", ctx([[1.0, 1.0], [-1.0, -1.0]], entropy=[[0.5, 1.5], [0.5, 2.0]])
    )
    assert_close(out.advantages_BT, torch.tensor([[1.5, 2.5], [-2.6, -1.4]]))
    plain = apply_weight(
        "entropy_weighted",
        ctx([[1.0, 1.0], [-1.0, -1.0]], entropy=[[0.5, 1.5], [0.5, 2.0]]),
        {"alpha2": 0.0},
    )
    assert_close(plain.advantages_BT, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


@pytest.mark.parametrize(
    "entropy,expected",
    [
        (0.2, [0.5, 1.0, 1.0, 1.5]),  # mean H 0.2 < target 0.5: g = +1, raise entropy
        (1.0, [1.5, 1.0, 1.0, 0.5]),  # mean H 1.0 > target: g = -1, lower entropy
    ],
)
def test_surprisal_reweight_stare_worked_example(entropy, expected):
    # surprisal s = -logp_old = [0.1, 1, 2, 3]; quantile 0.25: hi = Q_0.75 = 2 + 0.25 = 2.25
    # -> {3.0}; lo = Q_0.25 = 0.1 + 0.75 * 0.9 = 0.775 -> {0.1}. All A > 0: token 3 (rare) is
    # entropy-raising (E+), token 0 (likely) entropy-lowering (E-); lambda = 0.5
    out = apply_weight(
        "surprisal_reweight",
        ctx([[1.0] * 4], old=[[-0.1, -1.0, -2.0, -3.0]], entropy=[[entropy] * 4]),
        {"quantile": 0.25, "strength": 0.5, "target_entropy": 0.5},
    )
    assert_close(out.advantages_BT, torch.tensor([expected]))


def test_entropy_change_steer_worked_example():
    # c = A (logp_old + H) = [1 * (-0.5 + 1), -1 * (-2 + 1)] = [0.5, 1.0]; mean |c| = 0.75
    # z = [0.6667, 1.3333]; w = 1 - 0.5 z = [0.6667, 0.3333]; A' = [0.6667, -0.3333]
    out = apply_weight(
        "entropy_change", ctx([[1.0, -1.0]], old=[[-0.5, -2.0]], entropy=[[1.0, 1.0]])
    )
    assert_close(out.advantages_BT, torch.tensor([[2 / 3, -1 / 3]]))
    off = apply_weight(
        "entropy_change",
        ctx([[1.0, -1.0]], old=[[-0.5, -2.0]], entropy=[[1.0, 1.0]]),
        {"beta": 0.0},
    )
    assert_close(off.advantages_BT, torch.tensor([[1.0, -1.0]]))


def test_uncertainty_shaping_ucas_worked_example():
    # row 0: A = +1, p = 0.5 per token: c = 0.5; A' = 1 (1 + 0.5 * 0.5) - 0.1 * 0.5 = 1.2
    # row 1: A = -1, p = 0.8: c = 0.8; A' = -1 (1 + 0.5 * 0.8) - 0.1 * 0.8 = -1.48
    old = [[math.log(0.5)] * 2, [math.log(0.8)] * 2]
    out = apply_weight("uncertainty_shaping", ctx([[1.0, 1.0], [-1.0, -1.0]], old=old))
    assert_close(out.advantages_BT, torch.tensor([[1.2, 1.2], [-1.48, -1.48]]))
    off = apply_weight(
        "uncertainty_shaping", ctx([[1.0, 1.0], [-1.0, -1.0]], old=old), {"alpha": 0.0, "beta": 0.0}
    )
    assert_close(off.advantages_BT, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


def test_d3s_worked_example_and_relaxed_schedule():
    # one group, sample advantages [1.5, 0.5, -0.5, -1.5]; k = 0.5 * 4 = 2 -> the max-variance
    # pair is {1.5, -1.5} (var 2.25). Their |A| H: row 0 [1.5, 3.0], row 3 [0.75, 4.5];
    # token_frac 0.5 -> tau = Q_0.5 of [0.75, 1.5, 3, 4.5] = 2.25 -> keep 3.0 and 4.5
    adv = [[1.5, 1.5], [0.5, 0.5], [-0.5, -0.5], [-1.5, -1.5]]
    entropy = [[1.0, 2.0], [1.0, 1.0], [1.0, 1.0], [0.5, 3.0]]
    out = apply_weight("d3s", ctx(adv, entropy=entropy, groups=[0, 0, 0, 0]))
    assert_close(out.advantages_BT, torch.tensor([[0.0, 1.5], [0.0, 0.0], [0.0, 0.0], [0.0, -1.5]]))
    relaxed = apply_weight("d3s", ctx(adv, entropy=entropy, groups=[0, 0, 0, 0], step=100))
    assert_close(relaxed.advantages_BT, torch.tensor(adv))


def test_nat_rpc_weights_are_inverse_inclusion_probabilities():
    # n = 4 loss tokens: pi_j = (n - j + 1) / n = [1, 0.75, 0.5, 0.25]; kept tokens form a
    # prefix and weigh 1 / pi_j = [1, 4/3, 2, 4]
    out = apply_weight(
        "nat", ctx([[0.0, 1.0, 1.0, 1.0, 1.0]], [[0, 1, 1, 1, 1]]), {"scheme": "rpc", "seed": 3}
    )
    w = out.advantages_BT[0, 1:]
    kept = int((w > 0).sum())
    assert kept >= 1 and bool((w[:kept] > 0).all()) and bool((w[kept:] == 0).all())
    assert_close(w[:kept], torch.tensor([1.0, 4 / 3, 2.0, 4.0])[:kept])
    assert float(out.advantages_BT[0, 0]) == 0.0


@pytest.mark.parametrize("scheme", ["urs", "rpc"])
def test_nat_horvitz_thompson_is_unbiased_in_expectation(scheme):
    # E[w_t] = 1 for every loss token: averaged over 1500 independent steps each token's weight
    # is 1 within sampling error (worst: rpc's last token, w = 4 w.p. 1/4, var 3: std of the
    # mean sqrt(3 / 1500) = 0.045, so 0.2 is over 4 sigma)
    adv = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    mask = [[1, 1, 1, 1], [1, 1, 0, 0]]
    total = torch.zeros(2, 4)
    draws = 1500
    for step in range(draws):
        total += apply_weight("nat", ctx(adv, mask, step=step), {"scheme": scheme}).advantages_BT
    mean = total / draws
    assert_close(mean, torch.tensor(adv), atol=0.2, rtol=0)
    assert bool((mean[1, 2:] == 0).all())  # padding never selected


def test_prefix_focus_pppo_schedule():
    # n = 4 loss tokens; step 0: rho = 0.25 -> 1 token; step 50 of 100: rho = 0.25 + 0.75 * 0.5
    # = 0.625 -> ceil(2.5) = 3 tokens; step 100: all 4
    base = ctx([[0.0, 1.0, 1.0, 1.0, 1.0]], [[0, 1, 1, 1, 1]])
    for step, kept in [(0, 1), (50, 3), (100, 4)]:
        out = apply_weight(
            "prefix_focus", ctx([[0.0, 1.0, 1.0, 1.0, 1.0]], [[0, 1, 1, 1, 1]], step=step)
        )
        expected = [0.0] + [1.0] * kept + [0.0] * (4 - kept)
        assert_close(out.advantages_BT, torch.tensor([expected]))
    assert base.step == 0


def test_delta_logp_worked_example():
    # p = [1.0, 0.5]: w = 1 + (1 - p) = [1, 1.5]; mean 1.25 -> [0.8, 1.2]
    out = apply_weight("delta_logp", ctx([[1.0, 1.0]], old=[[0.0, math.log(0.5)]]))
    assert_close(out.advantages_BT, torch.tensor([[0.8, 1.2]]))


def test_balanced_aggregation_weights():
    # N = 6 loss tokens, N+ = 3, N- = 1: w+ = 6 / 6 = 1, w- = 6 / 2 = 3; with token_mean the loss
    # is (1/2) sum_+ l / 3 + (1/2) sum_- l / 1
    out = apply_weight("balanced", ctx([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]))
    assert_close(out.advantages_BT, torch.tensor([[1.0, 1.0, 1.0], [-3.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_every_weight_keeps_padding_zero_and_is_finite_on_degenerate_input(name):
    # all-equal entropies and advantages, one padded position, a group of 2, a singleton and
    # a sample without any loss token (prompt only)
    c = ctx(
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
        [[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]],
        entropy=[[0.0, 0.0, 5.0]] * 4,
        old=[[0.0, 0.0, 0.0]] * 4,
        groups=[0, 0, 1, 2],
    )
    out = apply_weight(name, c)
    assert bool(torch.isfinite(out.advantages_BT).all())
    assert bool((out.advantages_BT[:, 2] == 0).all()) and bool((out.advantages_BT[3] == 0).all())


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_every_weight_handles_a_batch_without_loss_tokens(name):
    c = ctx([[0.0, 0.0]] * 2, [[0, 0], [0, 0]], entropy=[[1.0, 2.0]] * 2, groups=[0, 0])
    out = apply_weight(name, c)
    assert_close(out.advantages_BT, torch.zeros(2, 2))


def test_unknown_parameter_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="top_frac"):
        apply_weight("high_entropy_only", ctx(ADV, MASK, entropy=ENTROPY), {"top_fraction": 1})
