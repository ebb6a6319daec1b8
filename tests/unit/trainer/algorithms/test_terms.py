"""Worked examples and expectation checks of the regularizer terms (regularizers.TERMS)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.regularizers import TERMS, apply_term

from .helpers import ctx

LOGITS = [0.3, -0.7, 1.1]
TEACHER = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5], dtype=torch.float64), dim=0)


def expected_grad(name: str) -> torch.Tensor:
    """E_{y ~ pi}[grad_theta term(y)] computed exactly: sum_y pi(y) grad term(y) over the 3
    outcomes of a softmax policy with logits theta."""
    theta = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, dim=0)
    total = torch.zeros((), dtype=torch.float64)
    for y in range(3):
        c = ctx([[0.0]], logp=logp[y].reshape(1, 1), teacher=[[float(TEACHER[y])]])
        term = apply_term(name, c).sum()
        total = total + logp[y].exp().detach() * term
    (grad,) = torch.autograd.grad(total, theta)
    return grad


def exact_grad(fn) -> torch.Tensor:
    theta = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(fn(torch.log_softmax(theta, dim=0)), theta)
    return grad


def entropy(logp):
    return -(logp.exp() * logp).sum()


def test_entropy_bonus_sampled_is_an_unbiased_gradient_of_minus_entropy():
    assert_close(expected_grad("entropy_bonus_sampled"), exact_grad(lambda lp: -entropy(lp)))


def test_entropy_min_is_an_unbiased_gradient_of_entropy():
    assert_close(expected_grad("entropy_min"), exact_grad(entropy))


def test_distill_rkl_is_an_unbiased_gradient_of_reverse_kl():
    assert_close(
        expected_grad("distill_rkl"), exact_grad(lambda lp: (lp.exp() * (lp - TEACHER)).sum())
    )


def test_distill_fkl_is_an_unbiased_gradient_of_forward_kl():
    assert_close(
        expected_grad("distill_fkl"), exact_grad(lambda lp: (TEACHER.exp() * (TEACHER - lp)).sum())
    )


def test_distill_mixed_is_the_weighted_sum():
    assert_close(
        expected_grad("distill_mixed"),
        0.5 * expected_grad("distill_fkl") + 0.5 * expected_grad("distill_rkl"),
    )


def test_distill_values_worked_example():
    # pi(y) = 0.5, q(y) = 0.25: rkl value log 0.5 - log 0.25 = 0.693147;
    # fkl value q / pi (log q - log pi) = 0.5 * -0.693147 = -0.346574
    c = ctx([[0.0]], logp=torch.tensor([[math.log(0.5)]]), teacher=[[math.log(0.25)]])
    assert float(apply_term("distill_rkl", c)) == pytest.approx(0.693147, abs=1e-6)
    assert float(apply_term("distill_fkl", c)) == pytest.approx(-0.346574, abs=1e-6)


def test_grsp_worked_example():
    # group lengths [2, 4]: mean 3, std sqrt(2) = 1.414214, z = [-0.7071, 0.7071]
    # A_pen = -z = [0.7071, -0.7071]; term = -A_pen logp: d/dlogp = [-0.7071, +0.7071]
    logp = torch.full((2, 4), -1.0, requires_grad=True)
    c = ctx([[0.0] * 4] * 2, [[1, 1, 0, 0], [1, 1, 1, 1]], logp=logp, groups=[0, 0])
    term = apply_term("grsp", c)
    torch.where(c.loss_mask_BT, term, 0.0).sum().backward()
    s = 1 / math.sqrt(2)
    assert_close(logp.grad, torch.tensor([[-s, -s, 0.0, 0.0], [s, s, s, s]]))


def test_grsp_equal_lengths_give_zero():
    logp = torch.full((2, 2), -1.0)
    term = apply_term("grsp", ctx([[0.0] * 2] * 2, logp=logp, groups=[0, 0]))
    assert_close(term, torch.zeros(2, 2))


def test_simko_worked_example():
    # one position at or above min_entropy 0: top-3 logprobs [-0.5, -1.5, -2.5]
    # A = +1, sampled token = top-2 (logp -1.5): l = -1 * 0.1 * (mean(-0.5, -1.5, -2.5) + 1.5)
    # = -0.1 * (-1.5 + 1.5) = 0; gradient -0.1 / 3 on each top-k logprob and +0.1 on logp
    topk = torch.tensor([[[-0.5, -1.5, -2.5]]], requires_grad=True)
    logp = torch.tensor([[-1.5]], requires_grad=True)
    c = ctx([[1.0]], entropy=[[1.0]], logp=logp, topk=topk)
    term = apply_term("simko", c, {"min_entropy": 0.0})
    assert float(term.detach()) == pytest.approx(0.0)
    term.sum().backward()
    assert_close(topk.grad, torch.full((1, 1, 3), -0.1 / 3))
    assert_close(logp.grad, torch.tensor([[0.1]]))


def test_simko_penalizes_a_wrong_top1_token_harder():
    # A = -1, sampled = top-1 (logp -0.5): l = -(-1) (1.1 - 1) logp = 0.1 * -0.5 = -0.05
    topk = torch.tensor([[[-0.5, -1.5, -2.5]]])
    logp = torch.tensor([[-0.5]], requires_grad=True)
    term = apply_term(
        "simko", ctx([[-1.0]], entropy=[[1.0]], logp=logp, topk=topk), {"min_entropy": 0.0}
    )
    assert float(term.detach()) == pytest.approx(-0.05)


def test_lp_reg_worked_example():
    # top-3 probs [0.6, 0.35, 0.005]: 0.005 < 0.02 * 0.6 = 0.012 is noise; proxy =
    # [0.6, 0.35] / 0.95 = [0.631579, 0.368421]. The sampled token has p = 0.05: below
    # delta = 0.1 and above the noise floor 0.012, in a negative sample: a protected spark.
    # KL(proxy || pi) = 0.631579 ln(0.631579 / 0.6) + 0.368421 ln(0.368421 / 0.35) = 0.0513
    probs = torch.tensor([[[0.6, 0.35, 0.005]]])
    c = ctx([[-1.0]], logp=torch.tensor([[math.log(0.05)]]), topk=probs.log())
    expected = 0.631579 * math.log(0.631579 / 0.6) + 0.368421 * math.log(0.368421 / 0.35)
    assert float(apply_term("lp_reg", c)) == pytest.approx(expected, abs=1e-5)
    # positive advantage, or a likely token: no regularization
    assert (
        float(
            apply_term(
                "lp_reg", ctx([[1.0]], logp=torch.tensor([[math.log(0.05)]]), topk=probs.log())
            )
        )
        == 0.0
    )


@pytest.mark.parametrize(
    "direction,expected",
    [
        # K = 1: q = [0.5] (tail 0.5), pi = [0.25] (tail 0.75)
        # reverse: 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = -0.173287 + 0.304099 = 0.130812
        # forward: 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.346574 - 0.202733 = 0.143841
        ("reverse", 0.130812),
        ("forward", 0.143841),
        ("mixed", 0.5 * (0.130812 + 0.143841)),
    ],
)
def test_distill_topk_with_tail_bin_worked_example(direction, expected):
    c = dataclasses.replace(
        ctx([[0.0]]),
        teacher_topk_logprobs_BTK=torch.tensor([[[math.log(0.5)]]]),
        student_at_teacher_topk_BTK=torch.tensor([[[math.log(0.25)]]]),
    )
    assert float(apply_term("distill_topk", c, {"direction": direction})) == pytest.approx(
        expected, abs=1e-5
    )


def test_distill_topk_is_zero_when_student_equals_teacher_and_exact_at_full_vocab():
    q = torch.log_softmax(torch.tensor([[[2.0, 0.5, -1.0]]]), dim=-1)
    same = dataclasses.replace(
        ctx([[0.0]]), teacher_topk_logprobs_BTK=q, student_at_teacher_topk_BTK=q.clone()
    )
    assert float(apply_term("distill_topk", same)) == pytest.approx(0.0, abs=1e-5)
    pi = torch.log_softmax(torch.tensor([[[0.0, 1.0, 0.0]]]), dim=-1)
    full = dataclasses.replace(
        ctx([[0.0]]), teacher_topk_logprobs_BTK=q, student_at_teacher_topk_BTK=pi
    )
    exact = float((pi.exp() * (pi - q)).sum())  # K = V: the tail bin is empty
    assert float(apply_term("distill_topk", full)) == pytest.approx(exact, abs=1e-4)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", *sorted(set(TERMS) - {"distill_topk"})])
def test_every_term_is_finite_on_all_equal_inputs(name):
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    c = ctx(
        [[0.0, 0.0]] * 2,
        logp=logp,
        entropy=[[0.5, 0.5]] * 2,
        teacher=[[-1.0, -1.0]] * 2,
        topk=torch.full((2, 2, 3), -1.0),
        groups=[0, 0],
    )
    term = apply_term(name, c)
    assert term.shape == (2, 2)
    assert bool(torch.isfinite(term).all())
