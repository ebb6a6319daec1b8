"""Worked examples for the advantage estimators, including BUG-12 cases A-D."""

from __future__ import annotations

import dataclasses
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
    opd,
    opd_plus_rl,
    quantile,
    rloo,
)

CFG = AdvantageConfig(std_floor=1e-3)


def inputs(rewards, groups=None, dtype=torch.float32) -> AdvantageInputs:
    groups = groups if groups is not None else [0] * len(rewards)
    return AdvantageInputs(torch.tensor(rewards, dtype=dtype), torch.tensor(groups))


GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "quantile"]


def test_registry_names_match_settings():
    from flywheel.core.settings import TrainerSettings  # noqa: PLC0415

    assert {"grpo", "dr_grpo", "rloo", "quantile", "opd", "opd_plus_rl"} <= set(ADVANTAGES)
    for name in ADVANTAGES:
        assert TrainerSettings(algorithm={"advantage": name}).algorithm.advantage == name


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


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_bug12_case_b_no_nan(name):
    # [0.4]*7 + [0.0]: the naive E[x^2]-E[x]^2 of seven fp32 0.4s is negative -> sqrt NaN.
    out = ADVANTAGES[name](inputs([0.4] * 7 + [0.0]), CFG)
    assert torch.isfinite(out.advantages_B).all()
    # the seven identical 0.4s alone: variance exactly 0 -> exact zeros, counted as zero std
    same = ADVANTAGES[name](inputs([0.4] * 7), CFG)
    assert torch.equal(same.advantages_B, torch.zeros(7))
    assert same.metrics["adv/frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
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


def test_quantile_two_regime_gate_worked_example():
    # K = 0.5, Q_K = r_(ceil(K n)) of the sorted group (1-based).
    # hard group [0, 0, 0, 1] (p = 0.25 <= 1 - K): sorted [0, 0, 0, 1], ceil(2) = 2nd -> Q = 0
    #   std: mean 0.25, sum sq = 3 * 0.0625 + 0.5625 = 0.75, var = 0.75 / 3 = 0.25, std = 0.5
    #   A = (r - 0) / 0.5 = [0, 0, 0, 2]: only the rare success gets signal
    # easy group [1, 1, 1, 0] (p = 0.75 > 1 - K): sorted [0, 1, 1, 1] -> Q = 1, std 0.5
    #   A = (r - 1) / 0.5 = [0, 0, 0, -2]: only the remaining failure gets signal
    out = quantile(inputs([0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]), CFG)
    assert_close(out.advantages_B, torch.tensor([0.0, 0, 0, 2, 0, 0, 0, -2]))


def test_quantile_k_moves_the_gate():
    # [0, 0, 1, 1], K = 0.75: ceil(0.75 * 4) = 3rd sorted value = 1 (p = 0.5 > 1 - K = 0.25)
    # std: mean 0.5, sum sq = 1, var = 1/3, std = 0.57735; A = (r - 1) / 0.57735 = -1.732051, 0
    out = quantile(inputs([0, 0, 1, 1]), dataclasses.replace(CFG, params={"k": 0.75}))
    assert_close(out.advantages_B, torch.tensor([-1.732051, -1.732051, 0, 0]), atol=1e-5, rtol=0)
    # K = 0.25: ceil(1) = 1st sorted value = 0 -> A = r / 0.57735 = 0, 0, 1.732051, 1.732051
    out = quantile(inputs([0, 0, 1, 1]), dataclasses.replace(CFG, params={"k": 0.25}))
    assert_close(out.advantages_B, torch.tensor([0, 0, 1.732051, 1.732051]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        quantile(inputs([0, 1]), dataclasses.replace(CFG, params={"k": 1.5}))


@pytest.mark.parametrize("seed", range(5))
def test_quantile_half_is_median_centering_on_symmetric_rewards(seed):
    # symmetric group c +- d_j (odd size: the centre c is in it): the K = 0.5 baseline is the
    # median (= c), so A = (r - median) / std; here the median also equals the mean (= grpo)
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(3, generator=gen, dtype=torch.float64)
    c = float(torch.randn(1, generator=gen))
    rewards = torch.cat([c - d, torch.tensor([c], dtype=torch.float64), c + d])
    out = quantile(AdvantageInputs(rewards, torch.zeros(7, dtype=torch.int64)), CFG)
    expected = ((rewards - rewards.median()) / rewards.std()).float()
    assert_close(out.advantages_B, expected, atol=1e-6, rtol=0)
    assert_close(
        out.advantages_B,
        grpo(inputs(rewards.tolist(), dtype=torch.float64), CFG).advantages_B,
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_empty_batch_gives_empty_advantages_and_finite_metrics(name):
    out = ADVANTAGES[name](AdvantageInputs(torch.zeros(0), torch.zeros(0, dtype=torch.int64)), CFG)
    assert out.advantages_B.shape == (0,)
    assert all(math.isfinite(v) for v in out.metrics.values())


def teacher_inputs(rewards=(1.0, 0.0)) -> AdvantageInputs:
    # row 0: 2 teacher tokens then one without (NaN); row 1: 1 teacher token
    teacher = torch.tensor([[-0.5, -1.0, float("nan")], [-2.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.0, -0.5, -3.0], [-1.5, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return AdvantageInputs(
        torch.tensor(rewards), torch.zeros(2, dtype=torch.int64), teacher, rollout, mask
    )


def test_opd_worked_example():
    # A_t = teacher - rollout: row 0: -0.5 - -1.0 = 0.5, -1.0 - -0.5 = -0.5, no teacher -> 0
    #                          row 1: -2.0 - -1.5 = -0.5, then no teacher -> 0, 0
    out = opd(teacher_inputs(), CFG)
    assert_close(out.advantages_BT, torch.tensor([[0.5, -0.5, 0.0], [-0.5, 0.0, 0.0]]))
    # per-sample means over teacher tokens: (0.5 - 0.5) / 2 = 0, -0.5 / 1 = -0.5
    assert_close(out.advantages_B, torch.tensor([0.0, -0.5]))
    assert out.metrics["adv/teacher_token_frac"] == pytest.approx(3 / 6)
    assert out.metrics["adv/mean"] == pytest.approx((0.5 - 0.5 - 0.5) / 3)
    assert torch.isfinite(out.advantages_BT).all()


def test_opd_mask_defaults_to_finite_teacher_logprobs_and_missing_inputs_raise():
    full = teacher_inputs()
    no_mask = dataclasses.replace(full, teacher_mask_BT=None)
    # row 1's zeros are finite, so they count as teacher tokens: 0 - -1.0 = 1.0
    assert_close(opd(no_mask, CFG).advantages_BT, torch.tensor([[0.5, -0.5, 0], [-0.5, 1, 1]]))
    with pytest.raises(ValueError):
        opd(inputs([1.0, 0.0]), CFG)
    with pytest.raises(ValueError):
        opd_plus_rl(inputs([1.0, 0.0]), CFG)


def test_opd_plus_rl_worked_example():
    # grpo on [1, 0]: mean 0.5, std = sqrt(0.5) = 0.707107, A = [+0.707107, -0.707107]
    # w_opd = 1, w_rl = 0.5: A_t = gap_t + 0.5 * A_i, the RL part on every token
    #   row 0: 0.5 + 0.353553 = 0.853553, -0.5 + 0.353553 = -0.146447, 0 + 0.353553
    #   row 1: -0.5 - 0.353553 = -0.853553, -0.353553, -0.353553
    cfg = dataclasses.replace(CFG, params={"opd_weight": 1.0, "rl_weight": 0.5})
    out = opd_plus_rl(teacher_inputs(), cfg)
    expected = torch.tensor([[0.853553, -0.146447, 0.353553], [-0.853553, -0.353553, -0.353553]])
    assert_close(out.advantages_BT, expected, atol=1e-5, rtol=0)


def test_opd_plus_rl_reduces_to_its_parts():
    rl_only = opd_plus_rl(teacher_inputs(), dataclasses.replace(CFG, params={"opd_weight": 0.0}))
    grpo_B = grpo(teacher_inputs(), CFG).advantages_B
    assert_close(rl_only.advantages_BT, grpo_B[:, None].expand(2, 3))
    opd_only = opd_plus_rl(teacher_inputs(), dataclasses.replace(CFG, params={"rl_weight": 0.0}))
    assert_close(opd_only.advantages_BT, opd(teacher_inputs(), CFG).advantages_BT)
    # all-equal rewards: the RL part is exactly 0, no NaN
    same = opd_plus_rl(teacher_inputs(rewards=(1.0, 1.0)), CFG)
    assert_close(same.advantages_BT, opd(teacher_inputs(), CFG).advantages_BT)
    with pytest.raises(ValueError):
        opd_plus_rl(teacher_inputs(), dataclasses.replace(CFG, params={"rl_advantage": "opd"}))
