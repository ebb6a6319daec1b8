"""Worked examples and properties of the KL estimators k1, k2, k3 and the entropy bonus."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.regularizers import (
    KL_ESTIMATORS,
    REGULARIZERS,
    TERMS,
    entropy_bonus,
    kl_k1,
    kl_k2,
    kl_k3,
)


def test_registries():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert set(REGULARIZERS) == {"entropy_bonus"}
    assert {
        "entropy_bonus_sampled",
        "entropy_min",
        "distill_rkl",
        "distill_fkl",
        "distill_mixed",
        "grsp",
    } <= set(TERMS)


def test_kl_worked_example():
    # pi(y) = 0.5, ref(y) = 0.25: log r = log(ref / pi) = log 0.5 = -0.693147
    # k1 = -log r = 0.693147; k2 = 0.693147^2 / 2 = 0.240227; k3 = (0.5 - 1) + 0.693147 = 0.193147
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    assert_close(kl_k1(logp, ref), torch.tensor([[0.693147]]))
    assert_close(kl_k2(logp, ref), torch.tensor([[0.240227]]))
    assert_close(kl_k3(logp, ref), torch.tensor([[0.193147]]))
    # identical policies: every estimator is exactly 0
    for fn in KL_ESTIMATORS.values():
        assert torch.equal(fn(logp, logp), torch.zeros(1, 1))


def test_k3_and_k2_are_non_negative_and_finite_far_off_policy():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 8, generator=gen) * 5
    ref = torch.randn(4, 8, generator=gen) * 5
    ref[0, 0] = -1e4  # far off: log r clamped, no overflow
    for fn in (kl_k2, kl_k3):
        out = fn(logp, ref)
        assert (out >= 0).all()
        assert torch.isfinite(out).all()


def test_k1_and_k3_means_estimate_the_true_kl():
    # pi = [0.5, 0.3, 0.2], ref = [0.2, 0.3, 0.5]:
    # KL(pi || ref) = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = 0.458145 + 0 - 0.183258 = 0.274887
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.3, 0.5])
    true_kl = float((pi * (pi / ref).log()).sum())
    assert true_kl == pytest.approx(0.274887, abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    y = torch.multinomial(pi, 20000, replacement=True, generator=gen)
    logp, ref_logp = pi.log()[y][None], ref.log()[y][None]  # (1, 20000)
    # std of the k1 sample mean is about sqrt(0.51 / 20000) = 0.005: 0.03 is 6 sigma
    assert float(kl_k1(logp, ref_logp).mean()) == pytest.approx(true_kl, abs=0.03)
    assert float(kl_k3(logp, ref_logp).mean()) == pytest.approx(true_kl, abs=0.03)


def test_kl_gradient_flows_to_the_policy_only():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    kl_k3(logp, ref).sum().backward()
    # d k3 / d logp = -r + 1 = 1 - 0.5 = 0.5
    assert_close(logp.grad, torch.tensor([[0.5]]))


def test_entropy_bonus_worked_example():
    # H = [1.0, 0.5] nats, coef 0.01: l = -0.01 * H = [-0.01, -0.005]; d l / d H = -0.01
    entropy = torch.tensor([[1.0, 0.5]], requires_grad=True)
    out = entropy_bonus(entropy, 0.01)
    assert_close(out, torch.tensor([[-0.01, -0.005]]))
    out.sum().backward()
    assert_close(entropy.grad, torch.tensor([[-0.01, -0.01]]))
