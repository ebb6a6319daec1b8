"""Worked examples and properties of the token-level advantage estimators
(advantages_token.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInputs,
    grpo,
)

S = 1 / math.sqrt(2)
"""GRPO advantage of a two-member group with rewards [1, 0]: (1 - 0.5) / std, std = 0.7071."""


def inputs(rewards, groups=None, **token_fields) -> AdvantageInputs:
    groups = groups if groups is not None else [0] * len(rewards)
    fields = {}
    for name, value in token_fields.items():
        dtype = torch.int64 if name in ("token_ids_BT", "turn_index_B") else torch.float32
        dtype = torch.bool if name in ("loss_mask_BT", "teacher_mask_BT") else dtype
        fields[name] = torch.tensor(value, dtype=dtype)
    return AdvantageInputs(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), **fields
    )


def run(name, inp, **params):
    return ADVANTAGES[name](inp, AdvantageConfig(params=params))


def test_tempo_worked_example_td_only_at_branch_tokens():
    # responses (after one prompt token): r0 = [5, 6], r1 = [5, 7], r2 = [8, 9]; rewards 1, 0, 0
    # GRPO: mean 1/3, std sqrt(1/3) = 0.57735: A = [1.154701, -0.577350, -0.577350]
    # tree: root (V 1/3) -> 5 (r0, r1: V 0.5) -> 6 (V 1) / 7 (V 0);  root -> 8 (V 0) -> 9
    # first token (root branches): r0, r1: (0.5 - 1/3) / 0.57735 = 0.288675; r2: -0.577350
    # second token: node 5 branches: r0 +0.5 / 0.57735 = 0.866025, r1 -0.866025; node 8 does
    # not branch: r2 gets no TD term
    out = run(
        "tempo",
        inputs(
            [1.0, 0.0, 0.0],
            token_ids_BT=[[1, 5, 6], [1, 5, 7], [1, 8, 9]],
            loss_mask_BT=[[0, 1, 1]] * 3,
        ),
    )
    expected = torch.tensor(
        [[0.0, 1.443376, 2.020726], [0.0, -0.288675, -1.443376], [0.0, -1.154701, -0.577350]]
    )
    assert_close(out.advantages_BT, expected, atol=1e-5, rtol=0)
    assert out.metrics["adv/branch_tokens"] == 5


def test_tempo_with_td_weight_zero_is_grpo():
    inp = inputs(
        [1.0, 0.0, 0.0],
        token_ids_BT=[[1, 5, 6], [1, 5, 7], [1, 8, 9]],
        loss_mask_BT=[[0, 1, 1]] * 3,
    )
    out = run("tempo", inp, td_weight=0.0)
    base = grpo(inp, AdvantageConfig()).advantages_B
    assert_close(out.advantages_BT[:, 1:], base.float()[:, None].expand(3, 2))


def test_ktae_worked_example():
    # r0 = [5, 6] reward 1 (correct), r1 = [5, 7] reward 0; GRPO +-0.7071
    # imp(5) = 1 - 1 = 0, imp(6) = 1 - 0 = 1, imp(7) = 0 - 1 = -1
    out = run(
        "ktae", inputs([1.0, 0.0], token_ids_BT=[[5, 6], [5, 7]], loss_mask_BT=[[1, 1], [1, 1]])
    )
    assert_close(out.advantages_BT, torch.tensor([[S, S + 1], [-S, -S - 1]]))


def test_zero_variance_worked_example():
    # group 0 all correct: alpha H = 0.1 [0.5, 1.0]; group 1 all wrong:
    # -alpha (max H - H) = -0.1 ([1, 1] - [0.5, 1.0]) = [-0.05, 0]; group 2 has spread: GRPO
    inp = inputs(
        [1.0, 1.0, 0.0, 0.0, 1.0, 0.0],
        [0, 0, 1, 1, 2, 2],
        loss_mask_BT=[[1, 1]] * 6,
        entropy_BT=[[0.5, 1.0], [0.2, 0.4], [0.5, 1.0], [0.3, 0.3], [1.0, 1.0], [1.0, 1.0]],
    )
    out = run("zero_variance", inp)
    expected = torch.tensor([[0.05, 0.1], [0.02, 0.04], [-0.05, 0.0], [0.0, 0.0], [S, S], [-S, -S]])
    assert_close(out.advantages_BT, expected)
    off = run("zero_variance", inp, alpha=0.0)
    assert_close(
        off.advantages_BT, grpo(inp, AdvantageConfig()).advantages_B[:, None].expand(6, 2).float()
    )


def test_miner_worked_example():
    # calibration group [1, 0]: GRPO +-0.7071, mean |A| = 0.7071 -> c = 0.5 * 0.7071 = 0.353553
    # all-correct group: u = -mean logp = [1, 2, 3]: mean 2, std 1 -> A = c [-1, 0, 1]; equal
    # token probabilities in a row -> focal weights 1
    logp = [[-1.0, -1.0], [-2.0, -2.0], [-3.0, -3.0], [-1.0, -1.0], [-1.0, -1.0]]
    out = run(
        "miner",
        inputs(
            [1.0, 1.0, 1.0, 1.0, 0.0],
            [0, 0, 0, 1, 1],
            loss_mask_BT=[[1, 1]] * 5,
            rollout_logprobs_BT=logp,
        ),
    )
    c = 0.5 * S
    expected = torch.tensor([[-c, -c], [0.0, 0.0], [c, c], [S, S], [-S, -S]])
    assert_close(out.advantages_BT, expected)


def test_miner_focal_credit():
    # p = [0.5, 0.9]: f = (1 - p)^2 = [0.25, 0.01]; mean 0.13 -> [1.923077, 0.076923]
    # group [1, 1] all correct, u = [-(ln .5 + ln .9) / 2, 1]: row 0 gets A = -c... (sign
    # by u), so |A_t| / |A| = f / mean f
    logp = [[math.log(0.5), math.log(0.9)], [-1.0, -1.0]]
    out = run("miner", inputs([1.0, 1.0], loss_mask_BT=[[1, 1], [1, 1]], rollout_logprobs_BT=logp))
    row = out.advantages_BT[0]
    assert_close(row / row.mean(), torch.tensor([1.923077, 0.076923]), atol=1e-5, rtol=0)


def test_a3po_worked_example():
    # A = +1, p = [0.1, 0.5]: low-prob token x 1.5 -> [1.5, 1.0]
    # A = -1, p = [0.9, 0.5]: high-prob token x 1.5 -> [-1.5, -1.0] (in units of 0.7071)
    logp = [[math.log(0.1), math.log(0.5)], [math.log(0.9), math.log(0.5)]]
    out = run("a3po", inputs([1.0, 0.0], loss_mask_BT=[[1, 1], [1, 1]], rollout_logprobs_BT=logp))
    assert_close(out.advantages_BT, torch.tensor([[1.5 * S, S], [-1.5 * S, -S]]))


def test_turn_level_compares_the_same_turn_across_episodes():
    # group 0, turns [0, 0, 1, 1]: turn 0 rewards [1, 0] -> +-0.7071; turn 1 [0.5, 0.5] -> 0
    out = run("turn_level", inputs([1.0, 0.0, 0.5, 0.5], turn_index_B=[0, 0, 1, 1]))
    assert_close(out.advantages_B, torch.tensor([S, -S, 0.0, 0.0]))


def test_turn_level_with_one_turn_is_grpo():
    inp = inputs([1.0, 0.0, 3.0, 2.0, 2.0], [0, 0, 1, 1, 1], turn_index_B=[0] * 5)
    assert_close(run("turn_level", inp).advantages_B, grpo(inp, AdvantageConfig()).advantages_B)


def test_segment_worked_example():
    # scores: sample 0 steps end at t1 (1.0) and t3 (0.0); sample 1 at t2 (1.0) and t3 (1.0)
    # group scores [1, 0, 1, 1]: mean 0.75, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    # normalized: 1 -> 0.5, 0 -> -1.5; token advantage = sum of the steps ending at or after t
    # sample 0: t1 0.5 - 1.5 = -1.0, t2 -1.5, t3 -1.5; sample 1: t1 1.0, t2 1.0, t3 0.5
    nan = float("nan")
    out = run(
        "segment",
        inputs(
            [0.0, 0.0],
            loss_mask_BT=[[0, 1, 1, 1]] * 2,
            step_rewards_BT=[[nan, 1.0, nan, 0.0], [nan, nan, 1.0, 1.0]],
        ),
    )
    assert_close(out.advantages_BT, torch.tensor([[0.0, -1.0, -1.5, -1.5], [0.0, 1.0, 1.0, 0.5]]))


def test_segment_all_equal_scores_give_zero_not_nan():
    out = run(
        "segment",
        inputs([0.0, 0.0], loss_mask_BT=[[1, 1]] * 2, step_rewards_BT=[[1.0, 1.0], [1.0, 1.0]]),
    )
    assert_close(out.advantages_BT, torch.zeros(2, 2))


def test_rlsd_direction_from_reward_magnitude_from_gap():
    # row 0 (A = +0.7071): gaps [ln 2, -ln 2] -> w = exp(+gap) = [2, 0.5]
    # row 1 (A = -0.7071): gaps [ln 2, -ln 4] -> w = exp(-gap) = [0.5, 4]
    teacher = [[math.log(2), -math.log(2)], [math.log(2), -math.log(4)]]
    out = run(
        "rlsd",
        inputs(
            [1.0, 0.0],
            loss_mask_BT=[[1, 1]] * 2,
            teacher_logprobs_BT=teacher,
            rollout_logprobs_BT=[[0.0, 0.0]] * 2,
        ),
    )
    assert_close(out.advantages_BT, torch.tensor([[2 * S, 0.5 * S], [-0.5 * S, -4 * S]]))
    assert bool((torch.sign(out.advantages_BT) == torch.tensor([[1.0, 1], [-1, -1]])).all())


def test_sdar_gate_worked_example():
    # gaps [2, -2], tau 1: g = sigmoid(+-2) = [0.880797, 0.119203]; lambda 0.5
    # A = A_grpo + 0.5 g d = [S + 0.880797, S - 0.119203]
    out = run(
        "sdar_gate",
        inputs(
            [1.0, 0.0],
            loss_mask_BT=[[1, 1]] * 2,
            teacher_logprobs_BT=[[2.0, -2.0], [0.0, 0.0]],
            rollout_logprobs_BT=[[0.0, 0.0]] * 2,
        ),
    )
    assert_close(out.advantages_BT[0], torch.tensor([S + 0.880797, S - 0.119203]))
    off = run(
        "sdar_gate",
        inputs(
            [1.0, 0.0],
            loss_mask_BT=[[1, 1]] * 2,
            teacher_logprobs_BT=[[2.0, -2.0], [0.0, 0.0]],
            rollout_logprobs_BT=[[0.0, 0.0]] * 2,
        ),
        weight=0.0,
    )
    assert_close(off.advantages_BT, torch.tensor([[S, S], [-S, -S]]))


def test_contrastive_sd_worked_example():
    # correct-hint teacher -1, wrong-hint teacher -3, student -2:
    # c = (-1 + 2) - (-3 + 2) = 2 -> A = A_grpo + 2
    out = run(
        "contrastive_sd",
        inputs(
            [1.0, 0.0],
            loss_mask_BT=[[1], [1]],
            teacher_logprobs_BT=[[-1.0], [-1.0]],
            wrong_hint_logprobs_BT=[[-3.0], [-3.0]],
            rollout_logprobs_BT=[[-2.0], [-2.0]],
        ),
    )
    assert_close(out.advantages_BT, torch.tensor([[S + 2], [-S + 2]]))


TOKEN_ESTIMATORS = [
    "tempo",
    "ktae",
    "zero_variance",
    "miner",
    "a3po",
    "rlsd",
    "sdar_gate",
    "contrastive_sd",
    "segment",
]


@pytest.mark.parametrize("name", TOKEN_ESTIMATORS)
def test_no_nan_on_all_equal_rewards_and_padding_stays_zero(name):
    # two groups of all-equal rewards, one singleton; last position is padding (NaN inputs)
    nan = float("nan")
    inp = inputs(
        [1.0, 1.0, 0.0, 0.0, 0.5],
        [0, 0, 1, 1, 2],
        token_ids_BT=[[3, 4, 0]] * 5,
        loss_mask_BT=[[1, 1, 0]] * 5,
        entropy_BT=[[0.5, 0.5, nan]] * 5,
        rollout_logprobs_BT=[[-1.0, -1.0, nan]] * 5,
        teacher_logprobs_BT=[[-1.0, -1.0, nan]] * 5,
        wrong_hint_logprobs_BT=[[-1.0, -1.0, nan]] * 5,
        step_rewards_BT=[[nan, 1.0, nan]] * 5,
    )
    out = run(name, inp)
    assert bool(torch.isfinite(out.advantages_BT).all()), name
    assert bool((out.advantages_BT[:, 2] == 0).all()), name


@pytest.mark.parametrize("name", TOKEN_ESTIMATORS)
def test_samples_without_loss_tokens_get_zero(name):
    # a group of two with reward spread, one member has no sampled token (prompt only)
    inp = inputs(
        [1.0, 0.0],
        token_ids_BT=[[3, 4], [3, 5]],
        loss_mask_BT=[[1, 1], [0, 0]],
        entropy_BT=[[0.5, 0.7]] * 2,
        rollout_logprobs_BT=[[-1.0, -2.0]] * 2,
        teacher_logprobs_BT=[[-1.5, -1.0]] * 2,
        wrong_hint_logprobs_BT=[[-2.0, -2.0]] * 2,
        step_rewards_BT=[[float("nan"), 1.0]] * 2,
    )
    out = run(name, inp)
    assert bool(torch.isfinite(out.advantages_BT).all()), name
    assert bool((out.advantages_BT[1] == 0).all()), name


def test_token_estimators_missing_inputs_raise_clearly():
    with pytest.raises(ValueError, match="token_ids_BT"):
        run("ktae", inputs([1.0, 0.0], loss_mask_BT=[[1], [1]]))
