"""Worked examples for the advantage estimators, including BUG-12 cases A-D."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInputs,
    dr_grpo,
    grpo,
    rloo,
)

CFG = AdvantageConfig(std_floor=1e-3)


def inputs(rewards, groups=None, dtype=torch.float32) -> AdvantageInputs:
    groups = groups if groups is not None else [0] * len(rewards)
    return AdvantageInputs(torch.tensor(rewards, dtype=dtype), torch.tensor(groups))


def test_registry_names_match_settings():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo"}


def test_grpo_worked_example_two_groups():
    # group 0: [1, 0, 0, 1]: mean 0.5; deviations +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3;
    #          std = 0.57735; A = +-0.5 / 0.57735 = +-0.866025
    # group 1: [2, 4, 9]: mean 5; deviations -3, -1, 4; var = (9 + 1 + 16) / 2 = 13;
    #          std = 3.605551; A = -0.832050, -0.277350, 1.109400
    out = grpo(inputs([1, 0, 0, 1, 2, 4, 9], [0, 0, 0, 0, 1, 1, 1]), CFG)
    expected = [0.866025, -0.866025, -0.866025, 0.866025, -0.832050, -0.277350, 1.109400]
    assert_close(out.advantages_B, torch.tensor(expected), atol=1e-5, rtol=0)
    assert out.advantages_B.dtype == torch.float32
    assert out.metrics["adv/max_abs"] == pytest.approx(1.109400, abs=1e-5)
    assert out.metrics["adv/frac_reward_zero_std"] == 0.0
    assert out.metrics["adv/groups"] == 2


def test_dr_grpo_worked_example():
    # [1, 0, 0, 0]: mean 0.25 -> A = [0.75, -0.25, -0.25, -0.25] (no std division)
    out = dr_grpo(inputs([1, 0, 0, 0]), CFG)
    assert_close(out.advantages_B, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_worked_example():
    # [1, 0, 0, 0]: baselines = mean of the other three = [0, 1/3, 1/3, 1/3]
    # A = [1, -1/3, -1/3, -1/3]  (= 4/3 * (r - 0.25))
    out = rloo(inputs([1, 0, 0, 0]), CFG)
    assert_close(out.advantages_B, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_bug12_case_a_fp32_residue_grpo_is_finite_and_bounded():
    # [0.35]*7 + [0.0]: mean = 2.45 / 8 = 0.30625; deviations 0.04375 (x7), -0.30625;
    # sum sq = 7 * 0.00191406 + 0.09378906 = 0.1071875; var = / 7 = 0.0153125; std = 0.1237437
    # A = 0.04375 / 0.1237437 = 0.353553 (x7); singleton -0.30625 / 0.1237437 = -2.474874
    out = grpo(inputs([0.35] * 7 + [0.0]), CFG)
    expected = torch.tensor([0.353553] * 7 + [-2.474874])
    assert_close(out.advantages_B, expected, atol=1e-5, rtol=0)
    assert out.metrics["adv/max_abs"] < 3.0


def test_bug12_case_a_leave_one_out_singleton_gets_minus_035():
    # singleton: 0.0 - mean(seven 0.35s) = -0.35 (no division by a residue std)
    # others:    0.35 - (6 * 0.35 + 0.0) / 7 = 0.35 - 0.3 = 0.05
    out = rloo(inputs([0.35] * 7 + [0.0]), CFG)
    assert_close(out.advantages_B, torch.tensor([0.05] * 7 + [-0.35]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_bug12_case_b_no_nan(name):
    # [0.4]*7 + [0.0]: the naive E[x^2]-E[x]^2 of seven fp32 0.4s is negative -> sqrt NaN.
    out = ADVANTAGES[name](inputs([0.4] * 7 + [0.0]), CFG)
    assert torch.isfinite(out.advantages_B).all()
    # the seven identical 0.4s alone: variance exactly 0 -> exact zeros, counted as zero std
    same = ADVANTAGES[name](inputs([0.4] * 7), CFG)
    assert torch.equal(same.advantages_B, torch.zeros(7))
    assert same.metrics["adv/frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_bug12_case_c_all_equal_gives_exact_zeros(name):
    out = ADVANTAGES[name](inputs([1.0, 1.0, 1.0, 1.0]), CFG)
    assert torch.equal(out.advantages_B, torch.zeros(4))
    assert out.metrics["adv/frac_reward_zero_std"] == 1.0
    assert out.metrics["adv/max_abs"] == 0.0


def test_bug12_case_d_cancelling_components():
    # c1 = [+5, -5, +5, -5], c2 = [-5, +5, -5, +5]: each has std 5.77 but the total is [0]*4
    c1 = torch.tensor([5.0, -5.0, 5.0, -5.0])
    c2 = torch.tensor([-5.0, 5.0, -5.0, 5.0])
    out = grpo(AdvantageInputs(c1 + c2, torch.zeros(4, dtype=torch.int64)), CFG)
    assert torch.equal(out.advantages_B, torch.zeros(4))
    assert out.metrics["adv/frac_reward_zero_std"] == 1.0


def test_std_below_floor_and_singletons_give_zero():
    # group 0: [0.5, 0.5005]: std = 0.0005 / sqrt(2) = 3.5e-4 < 1e-3 -> zeros
    # group 1: a singleton -> zero; group 2: [0, 1] -> +-0.7071 (std = 0.7071)
    out = grpo(inputs([0.5, 0.5005, 3.0, 0.0, 1.0], [0, 0, 1, 2, 2]), CFG)
    assert_close(out.advantages_B, torch.tensor([0, 0, 0, -0.707107, 0.707107]), atol=1e-5, rtol=0)
    assert out.metrics["adv/frac_reward_zero_std"] == pytest.approx(2 / 3)


def test_large_group_advantage_bounded_by_sqrt_n():
    # one success among 64: its z-score is (n - 1) / sqrt(n) = 63 / 8 = 7.875 at most
    out = grpo(inputs([1.0] + [0.0] * 63), CFG)
    assert out.metrics["adv/max_abs"] == pytest.approx(7.875, abs=1e-4)
    assert math.isfinite(out.metrics["adv/mean"])
