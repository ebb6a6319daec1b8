"""Worked examples of the ratio forms (policy losses) and the constant-normalizer aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizer,
    PPOClipConfig,
    gspo,
    ppo_clip,
)


def loss_inputs(logp, old, adv, mask=None, entropy=None):
    logp_BT = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old_BT = torch.tensor(old, dtype=torch.float64)
    mask_BT = (
        torch.ones_like(old_BT, dtype=torch.bool)
        if mask is None
        else torch.tensor(mask, dtype=torch.bool)
    )
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float64)
    return LossInputs(
        logp_BT, old_BT, torch.tensor(adv, dtype=torch.float64), mask_BT, entropy_BT=ent
    )


def grad_of(out, inp):
    out.token_loss_BT.sum().backward()
    return inp.logprobs_BT.grad


def test_cispo_worked_example_clipped_tokens_keep_their_gradient():
    # r = [e^0.5, e^-0.5] = [1.6487, 0.6065]; eps 0.2 / 0.28: sg weights [1.28, 0.8]
    # l = -w A logp: token 0 (A +1, logp -1): 1.28; token 1 (A -1, logp -2): -0.8 * 2 = -1.6
    # d l / d logp = -w A = [-1.28, +0.8] (PPO would give 0 for token 0: clipped)
    inp = loss_inputs([[-1.0, -2.0]], [[-1.5, -1.5]], [[1.0, -1.0]])
    out = POLICY_LOSSES["cispo"](inp, PPOClipConfig(0.2, 0.28))
    assert_close(out.token_loss_BT.detach(), torch.tensor([[1.28, -1.6]], dtype=torch.float64))
    assert_close(grad_of(out, inp), torch.tensor([[-1.28, 0.8]], dtype=torch.float64))


@pytest.mark.parametrize("w,expected", [("mean", None)])
def test_dhpo_mean_mixing_is_the_average_of_ppo_and_gspo(w, expected):
    inp = loss_inputs([[-1.0, -2.0, -0.5]], [[-1.1, -1.7, -0.5]], [[1.0, 1.0, 1.0]])
    cfg = PPOClipConfig(0.2, 0.28)
    out = POLICY_LOSSES["dhpo"](inp, cfg)
    tok = ppo_clip(inp, cfg).token_loss_BT
    seq = gspo(inp, PPOClipConfig(3e-4, 4e-4)).token_loss_BT
    assert_close(out.token_loss_BT, 0.5 * tok + 0.5 * seq)


def test_dhpo_entropy_mixing_weights():
    # H = [0.5, 1.0] -> w = H / max H = [0.5, 1.0]: the high-entropy token is pure ppo_clip
    inp = loss_inputs([[-1.0, -2.0]], [[-1.1, -1.7]], [[1.0, 1.0]], entropy=[[0.5, 1.0]])
    cfg = PPOClipConfig(0.2, 0.28, params={"mixing": "entropy"})
    out = POLICY_LOSSES["dhpo"](inp, cfg)
    tok = ppo_clip(inp, cfg).token_loss_BT
    seq = gspo(inp, PPOClipConfig(3e-4, 4e-4)).token_loss_BT
    assert_close(out.token_loss_BT[0, 1], tok[0, 1])
    assert_close(out.token_loss_BT[0, 0], 0.5 * tok[0, 0] + 0.5 * seq[0, 0])


def test_aspo_flips_the_ratio_of_positive_tokens():
    # token 0: A +1, r = 0.5 -> flipped weight 1 / 0.5 = 2: d l / d logp = -2 (PPO: -0.5)
    # token 1: A -1, r = 0.5 (inside 1 - 0.2? no: 0.5 < 0.8 and A < 0 -> PPO clip: grad 0)
    # token 2: A +1, r = 0.2 -> 1 / 0.2 = 5 capped at 3: grad -3
    inp = loss_inputs(
        [[math.log(0.5), math.log(0.5), math.log(0.2)]], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 1.0]]
    )
    out = POLICY_LOSSES["aspo"](inp, PPOClipConfig(0.2, 0.28))
    assert_close(grad_of(out, inp), torch.tensor([[-2.0, 0.0, -3.0]], dtype=torch.float64))


def test_cppo_position_thresholds_and_prefix_budget():
    # log r = 0.15 on 3 tokens (r = 1.161834), A = +1; eps by position: [0.1, 0.2, 0.3]
    # token 0: r > 1.1 -> clipped: loss -1.1, grad 0; token 1: r < 1.2 -> loss -r, grad -r
    # prefix drift D = [0, 0.15, 0.30]; budget 0.2 -> token 2 masked (loss 0, grad 0)
    r = math.exp(0.15)
    inp = loss_inputs([[0.15, 0.15, 0.15]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]])
    out = POLICY_LOSSES["cppo"](inp, PPOClipConfig(params={"prefix_budget": 0.2}))
    assert_close(out.token_loss_BT.detach(), torch.tensor([[-1.1, -r, 0.0]], dtype=torch.float64))
    assert_close(grad_of(out, inp), torch.tensor([[0.0, -r, 0.0]], dtype=torch.float64))


def test_cppo_with_uniform_eps_and_no_budget_is_ppo_clip():
    inp = loss_inputs([[-1.0, -2.0, -0.5]], [[-1.3, -1.7, -0.5]], [[1.0, -1.0, 0.5]])
    params = {"eps_early": 0.2, "eps_late": 0.2, "prefix_budget": 1e9}
    out = POLICY_LOSSES["cppo"](inp, PPOClipConfig(0.2, 0.2, params=params))
    assert_close(out.token_loss_BT, ppo_clip(inp, PPOClipConfig(0.2, 0.2)).token_loss_BT)


def test_prefix_ratio_worked_example():
    # log r = [0.1, 0.2, -0.1]; prefix sums [0, 0.1, 0.3]; log rho = [0.1, 0.3, 0.2]
    # rho = [1.105171, 1.349859, 1.221403]; A = +1, eps_high 0.28: loss = -min(rho, 1.28)
    inp = loss_inputs([[0.1, 0.2, -0.1]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]])
    out = POLICY_LOSSES["prefix_ratio"](inp, PPOClipConfig(0.2, 0.28))
    assert_close(
        out.token_loss_BT.detach(),
        torch.tensor([[-1.105171, -1.28, -1.221403]], dtype=torch.float64),
        atol=1e-6,
        rtol=0,
    )


def test_wapo_updates_only_on_positive_advantages():
    inp = loss_inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [[1.0, -1.0]])
    out = POLICY_LOSSES["wapo"](inp, PPOClipConfig())
    assert_close(out.token_loss_BT.detach(), torch.tensor([[-1.0, 0.0]], dtype=torch.float64))


def test_seq_elbo_ratio_worked_example():
    # log r = [0.1, 0.3]: log s = 0.2, s = 1.221403; A = 1, eps 0.3: no clip
    # l_b = -s on each token; d l_b / d logp_t = -s / 2 = -0.610701; summed over 2 tokens
    # (each carries l_b) -> -1.221403
    inp = loss_inputs([[0.1, 0.3]], [[0.0, 0.0]], [[1.0, 1.0]])
    out = POLICY_LOSSES["seq_elbo_ratio"](inp, PPOClipConfig(0.3, 0.3))
    s = math.exp(0.2)
    assert_close(out.token_loss_BT.detach(), torch.tensor([[-s, -s]], dtype=torch.float64))
    assert_close(grad_of(out, inp), torch.tensor([[-s, -s]], dtype=torch.float64))


def test_constant_normalizer_aggregation():
    # token sum 1 + 2 + 3 = 6, 2 sequences, k = 4: 6 / (2 * 4) = 0.75
    loss = torch.tensor([[1.0, 2.0], [3.0, 99.0]])
    mask = torch.tensor([[True, True], [True, False]])
    norm = LossNormalizer(tokens=3, sequences=2, constant_k=4)
    assert float(AGGREGATIONS["constant_normalizer"](loss, mask, norm)) == pytest.approx(0.75)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_loss_is_zero_and_finite_on_padding_even_with_nan(name):
    nan = float("nan")
    inp = loss_inputs(
        [[-1.0, nan]], [[-1.2, nan]], [[1.0, nan]], mask=[[1, 0]], entropy=[[0.5, nan]]
    )
    out = POLICY_LOSSES[name](inp, PPOClipConfig(0.2, 0.28))
    assert float(out.token_loss_BT.detach()[0, 1]) == 0.0
    assert bool(torch.isfinite(out.token_loss_BT).all())
    out.token_loss_BT.sum().backward()
    assert bool(torch.isfinite(inp.logprobs_BT.grad).all())


@pytest.mark.parametrize(
    "name",
    ["ppo_clip", "gspo", "cispo", "aspo", "cppo", "prefix_ratio", "wapo", "seq_elbo_ratio", "dhpo"],
)
def test_on_policy_gradient_is_minus_advantage_for_positive_tokens(name):
    # at r = 1 (on-policy) every form's gradient on a positive-advantage token is -A grad logp
    # (sequence forms: the sequence's tokens share it; here one token per sequence)
    inp = loss_inputs([[-1.0], [-2.0]], [[-1.0], [-2.0]], [[0.5], [2.0]])
    out = POLICY_LOSSES[name](inp, PPOClipConfig(0.2, 0.28))
    assert_close(grad_of(out, inp), torch.tensor([[-0.5], [-2.0]], dtype=torch.float64))
