"""OpenClaw-RL's combined advantage on live turns (`trainer.algorithm.live_advantage =
"opd_plus_rl"`): worked examples of A_t = w_opd * gap_t + w_rl * r, its one-signal cases, the
gap clip, and the settings that reach it."""

from __future__ import annotations

import pytest
import torch

from flywheel.core.codec import encode_sample
from flywheel.core.streams import StreamEntry
from flywheel.core.trainer_settings import AlgorithmSettings
from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig, AdvantageInputs
from flywheel.trainer.groups import GroupAssembler
from flywheel.trainer.step import prepare_batch

from .factories import make_sample, step_config


def live(reward=None, teacher=None, seed=0):
    """A live Sample: 2 prompt tokens, 3 sampled tokens with rollout logprob -1.0; `reward`
    None = the judge did not score it; `teacher` = logprobs on the 3 sampled tokens (None =
    no teacher signal)."""
    sample = make_sample(
        prompt_len=2,
        completion_len=3,
        group_id="",
        logprob=-1.0,
        seed=seed,
        reward=0.0 if reward is None else reward,
        has_reward=reward is not None,
    )
    if teacher is not None:
        sample.teacher_logprobs.extend([0.0, 0.0, *teacher])
        sample.teacher_mask.extend([0, 0, 1, 1, 1])
    return sample


def combined(params=None):
    algorithm = {"live_advantage": "opd_plus_rl"}
    if params is not None:
        algorithm["params"] = {"opd_plus_rl": params}
    return step_config(algorithm=algorithm)


def test_worked_example_both_signals_one_signal_and_defaults():
    # rollout logprob (pi_old) = -1.0 on each sampled token; w_opd = w_rl = 1.
    # both:    teacher [-0.5, -2.0, -1.0], judge r = -1
    #          gap = [-0.5+1, -2+1, -1+1] = [0.5, -1.0, 0.0]; A = gap + r = [-0.5, -2.0, -1.0]
    # reward:  no teacher, r = +1                       -> A = [1, 1, 1]
    # teacher: teacher [-0.25, -1.0, -3.0], no verdict  -> A = gap = [0.75, 0.0, -2.0]
    samples = [
        live(reward=-1.0, teacher=[-0.5, -2.0, -1.0], seed=1),
        live(reward=1.0, seed=2),
        live(teacher=[-0.25, -1.0, -3.0], seed=3),
    ]
    batch, metrics = prepare_batch([[s] for s in samples], combined())
    adv = batch.advantages_BT
    assert adv[0].tolist() == pytest.approx([0, 0, -0.5, -2.0, -1.0])
    assert adv[1].tolist() == pytest.approx([0, 0, 1.0, 1.0, 1.0])
    assert adv[2].tolist() == pytest.approx([0, 0, 0.75, 0.0, -2.0])
    assert metrics["adv_live/both_signals"] == 1
    assert metrics["adv_live/reward_only"] == 1
    assert metrics["adv_live/opd_only"] == 1
    assert metrics["adv_live/no_signal"] == 0
    # mean over the 9 sampled tokens: (-3.5 + 3 - 1.25) / 9 = -1.75 / 9
    assert metrics["adv_live/mean"] == pytest.approx(-1.75 / 9)


def test_weights_and_gap_clip_reach_the_advantage():
    # w_opd = 0.5, w_rl = 2, gap_clip = 0.6 nats; teacher [-0.5, -2.0, -1.0], rollout -1, r = +1
    # gap = [0.5, -1.0, 0.0] -> clipped [0.5, -0.6, 0.0]
    # A = 0.5 * [0.5, -0.6, 0.0] + 2 * 1 = [2.25, 1.7, 2.0]
    sample = live(reward=1.0, teacher=[-0.5, -2.0, -1.0])
    cfg = combined({"opd_weight": 0.5, "rl_weight": 2.0, "gap_clip": 0.6})
    cfg.algo.check()  # accepted: the part is selected by live_advantage
    batch, metrics = prepare_batch([[sample]], cfg)
    assert batch.advantages_BT[0].tolist() == pytest.approx([0, 0, 2.25, 1.7, 2.0])
    # adv/opd_mean is the clipped gap's mean over teacher tokens: (0.5 - 0.6 + 0) / 3
    assert metrics["adv_live/opd_mean"] == pytest.approx(-0.1 / 3)


def test_a_turn_with_neither_signal_gets_zero_and_is_counted(caplog):
    sample = live(seed=4)
    batch, metrics = prepare_batch([[sample]], combined())
    assert float(batch.advantages_BT.abs().sum()) == 0.0
    assert metrics["adv_live/no_signal"] == 1
    assert sample.sample_id in caplog.text


@pytest.mark.parametrize(
    "params, error",
    [
        ({"gap_clp": 0.5}, "unknown parameter 'gap_clp'"),
        ({"gap_clip": -1.0}, "gap_clip of 'opd_plus_rl' must be >= 0"),
        ({"opd_weight": "one"}, "must be like 1.0"),
    ],
)
def test_bad_parameters_are_refused_at_start(params, error):
    # the trainer checks its parts when it builds its StepConfig (StepConfig.from_settings)
    with pytest.raises(ValueError, match=error):
        combined(params).algo.check()


def test_parameters_without_the_combination_are_refused():
    cfg = step_config(algorithm={"params": {"opd_plus_rl": {"gap_clip": 0.5}}})
    with pytest.raises(ValueError, match="not selected"):
        cfg.algo.check()


def test_live_advantage_setting_refuses_a_typo():
    with pytest.raises(ValueError, match="opd_plus_rl"):
        AlgorithmSettings(live_advantage="opd_plus_r")  # type: ignore[arg-type]


def test_admission_keeps_an_unjudged_turn_with_teacher_logprobs():
    assembler = GroupAssembler(1, 60.0, live_samples=True, live_opd=True)
    taught = live(teacher=[-0.5, -2.0, -1.0], seed=5)
    neither = live(seed=6)
    assert assembler.add(StreamEntry("1-0", encode_sample(taught), taught)) is None
    drop = assembler.add(StreamEntry("2-0", encode_sample(neither), neither))
    assert drop is not None and drop.reason == "no_reward"


def test_gap_clip_also_applies_to_grouped_opd_plus_rl():
    # group of 2, rewards [1, 0]: GRPO mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> A = +-0.70711
    # one token each, rollout -1; teacher -0.5 (gap +0.5) and +1.0 (gap +2.0, clipped to 1.0)
    # A = 1 * gap + 1 * A_grpo = [0.5 + 0.70711, 1.0 - 0.70711] = [1.20711, 0.29289]
    inputs = AdvantageInputs(
        rewards_B=torch.tensor([1.0, 0.0]),
        group_index_B=torch.tensor([0, 0]),
        teacher_logprobs_BT=torch.tensor([[-0.5], [1.0]]),
        rollout_logprobs_BT=torch.tensor([[-1.0], [-1.0]]),
        teacher_mask_BT=torch.tensor([[True], [True]]),
    )
    out = ADVANTAGES["opd_plus_rl"](inputs, AdvantageConfig(params={"gap_clip": 1.0}))
    assert out.advantages_BT is not None
    assert out.advantages_BT[:, 0].tolist() == pytest.approx([1.20711, 0.29289], abs=1e-5)
