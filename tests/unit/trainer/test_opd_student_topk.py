"""`opd_plus_rl`'s `student_topk` (trainer/algorithms/opd_topk.py): the distillation term only
where the sampled token is among the student's k most likely tokens; worked examples, the ranks
of a real (tiny) policy, and the setting reaching the step's advantages."""

from __future__ import annotations

import pytest
import torch

from flywheel.core.trainer_settings import OptimSettings
from flywheel.trainer.algorithms import pipeline
from flywheel.trainer.algorithms.advantages import OPDPlusRLParams
from flywheel.trainer.algorithms.opd_topk import (
    restrict_to_student_topk,
    sampled_ranks,
    student_ranks,
)
from flywheel.trainer.step import build_optimizer, prepare_batch

from .factories import make_sample, step_config, tiny_model
from .test_live_combined import live


def test_sampled_ranks_count_strictly_larger_logits():
    # position 1 reads the logits at 0: (2, 5, 1, 3); token 3 -> only 5.0 is larger -> rank 1
    # position 2 reads the logits at 1: (0, 0, 9, 1); token 2 -> rank 0
    logits = torch.tensor([[[2.0, 5.0, 1.0, 3.0], [0.0, 0.0, 9.0, 1.0], [1.0, 1.0, 1.0, 1.0]]])
    ids = torch.tensor([[0, 3, 2]])
    assert sampled_ranks(logits, ids).tolist() == [[-1, 1, 0]]


def test_worked_example_restricts_only_the_distillation_term():
    # w_opd = w_rl = 1, reward 1, k = 2; teacher (-1.0, -2.0), rollout (-1.5, -1.0)
    # gaps (0.5, -1.0) -> advantages (1.5, 0.0); ranks (0, 3): the second token is outside the
    # student's top-2 and keeps only the reward term: (1.5, 1.0)
    adv = torch.tensor([[0.0, 1.5, 0.0]])
    teacher = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.0]])
    mask = torch.tensor([[False, True, True]])
    ranks = torch.tensor([[-1, 0, 3]])
    out, metrics = restrict_to_student_topk(
        adv, teacher, rollout, mask, mask, ranks, OPDPlusRLParams(student_topk=2)
    )
    assert out[0].tolist() == pytest.approx([0.0, 1.5, 1.0])
    assert metrics["adv/opd_student_topk_frac"] == 0.5  # 1 of 2 teacher tokens kept
    # with the gap clipped to 0.6 and w_opd 0.5: the removed part is 0.5 * -0.6 = -0.3
    out, _ = restrict_to_student_topk(
        torch.tensor([[0.0, 1.25, 0.7]]),  # 0.5 * (0.5, -0.6) + 1
        teacher,
        rollout,
        mask,
        mask,
        ranks,
        OPDPlusRLParams(student_topk=2, gap_clip=0.6, opd_weight=0.5),
    )
    assert out[0].tolist() == pytest.approx([0.0, 1.25, 1.0])
    with pytest.raises(ValueError, match="student_topk"):
        OPDPlusRLParams(student_topk=-1)


def test_student_ranks_match_the_full_logits_of_the_policy():
    model = tiny_model(seed=3)
    cfg = step_config(batch={"micro_batch_size": 1})
    samples = [make_sample(prompt_len=2, completion_len=3, seed=s, group_id="") for s in (1, 2)]
    batch, _ = prepare_batch([[s] for s in samples], cfg)
    ranks = student_ranks(model, batch, cfg)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    for b in range(2):
        for t in range(1, 5):
            if batch.loss_mask_BT[b, t]:
                row = logits[b, t - 1]
                expected = int((row > row[batch.input_ids_BT[b, t]]).sum())
                assert int(ranks[b, t]) == expected
            else:
                assert int(ranks[b, t]) == -1


def test_the_setting_reaches_the_step_advantages():
    model = tiny_model(seed=3)
    opt = build_optimizer(model, OptimSettings(lr=1e-3))
    sample = live(reward=1.0, teacher=[-0.5, -2.0, -1.0])  # gaps (0.5, -1.0, 0.0), rollout -1
    algorithm = {"live_advantage": "opd_plus_rl"}
    off = step_config(algorithm=algorithm)
    on = step_config(algorithm=algorithm | {"params": {"opd_plus_rl": {"student_topk": 2}}})
    on.algo.check()  # accepted
    assert on.algo.needs_entropy_pass and not off.algo.needs_entropy_pass
    batch, _ = prepare_batch([[sample]], on)
    assert batch.advantages_BT[0].tolist() == pytest.approx([0, 0, 1.5, 0.0, 1.0])
    unchanged, metrics = pipeline.batch_stage(model, opt, batch, off)
    assert unchanged is batch and metrics == {}
    new, metrics = pipeline.batch_stage(model, opt, batch, on)
    ranks = student_ranks(model, batch, on)[0]
    # each sampled token keeps its gap only when the tiny policy ranks it 0 or 1
    gaps = [0.5, -1.0, 0.0]
    expected = [0.0, 0.0] + [
        1.0 + (g if int(ranks[2 + i]) < 2 else 0.0) for i, g in enumerate(gaps)
    ]
    assert new.advantages_BT[0].tolist() == pytest.approx(expected, abs=1e-6)
    kept = sum(int(ranks[t]) < 2 for t in (2, 3, 4))
    assert kept < 3  # the restriction changed something (a random tiny policy ranks low)
    assert metrics["adv/opd_student_topk_frac"] == pytest.approx(kept / 3)
