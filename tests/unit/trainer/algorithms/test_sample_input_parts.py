"""The parts that read Sample-carried inputs, through the real entry points (`prepare_batch`,
`batch_stage`, `accumulate`, `train_step`): contrastive_sd (wrong-hint logprobs), segment (step
scores), turn_level (turn index), distill_topk (teacher top-k and the student gathered at its
ids)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.core.trainer_settings import AlgorithmSettings, OptimSettings
from flywheel.trainer.algorithms import pipeline
from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.algorithms.pipeline import AlgoConfig
from flywheel.trainer.batch import TOPK_ABSENT
from flywheel.trainer.logprobs import selected_token_logprobs
from flywheel.trainer.step import StepConfig, accumulate, build_optimizer, prepare_batch, train_step

from ..factories import make_sample, tiny_model
from ..factories import step_config as replaced
from .test_step_inputs import two_turn_sample

S = 1 / math.sqrt(2)
"""GRPO advantage of a two-member group with rewards [1, 0]: (1 - 0.5) / std, std = 0.7071."""


def step_config(advantage: str = "grpo", **algorithm) -> StepConfig:
    return replaced(
        algorithm={"advantage": advantage, "clip_eps_low": 0.2, "clip_eps_high": 0.28} | algorithm,
        batch={"logprob_chunk_tokens": 4},
    )


def test_contrastive_sd_through_prepare_batch():
    # group of two, rewards [1, 0] -> GRPO +-S; rollout -2, correct-hint teacher -1.
    # a: wrong hint -3, -2.5 -> c = (-1 + 2) - (-3 + 2) = 2 and (-1 + 2) - (-2.5 + 2) = 1.5
    # b: no wrong hint -> c = 0, the GRPO advantage alone
    teacher = {"teacher_logprobs": [0.0, 0.0, -1.0, -1.0], "teacher_mask": [0, 0, 1, 1]}
    a = make_sample(
        prompt_len=2,
        completion_len=2,
        reward=1.0,
        logprob=-2.0,
        wrong_hint="w",
        wrong_hint_logprobs=[0.0, 0.0, -3.0, -2.5],
        **teacher,
    )
    b = make_sample(prompt_len=2, completion_len=2, reward=0.0, logprob=-2.0, **teacher)
    batch, _ = prepare_batch([[a, b]], step_config("contrastive_sd"))
    assert_close(batch.advantages_BT, torch.tensor([[0, 0, S + 2, S + 1.5], [0, 0, -S, -S]]))


def test_segment_through_prepare_batch_counts_unaligned_samples():
    # a, b: step/0 scores turn one (tokens 2-3); the final turn (5-6) has no step score.
    # group step scores [1, 0]: mean 0.5, std 0.7071 -> normalized +-S, on token 3 of each row;
    # reverse cumsum: tokens 2, 3 (at or before the step's end) get it, turn two gets 0.
    # c: its step/0 names a turn it does not have (one assistant message, two runs): no score,
    # zero advantage, counted.
    a = two_turn_sample({"step/0": 1.0}, reward=1.0)
    b = two_turn_sample({"step/0": 0.0}, reward=0.0)
    c = two_turn_sample({"step/0": 1.0}, assistants=1)
    batch, metrics = prepare_batch([[a, b, c]], step_config("segment"))
    assert_close(
        batch.advantages_BT,
        torch.tensor([[0, 0, S, S, 0, 0, 0], [0, 0, -S, -S, 0, 0, 0], [0.0] * 7]),
    )
    assert metrics["samples/step_rewards_unaligned"] == 1.0


def test_turn_level_through_prepare_batch_uses_the_samples_turn_index():
    # one group, turns [0, 0, 1, 1], rewards [1, 0, 0.5, 0]: each turn is its own GRPO cell.
    # turn 0: [1, 0] -> +-S; turn 1: [0.5, 0], mean 0.25, std 0.3536 -> +-S. (One group of four
    # would give mean 0.375, std 0.4787 -> [1.306, -0.783, 0.261, -0.783].)
    samples = [
        make_sample(turn_index=t, reward=r, seed=i)
        for i, (t, r) in enumerate([(0, 1.0), (0, 0.0), (1, 0.5), (1, 0.0)])
    ]
    batch, _ = prepare_batch([samples], step_config("turn_level"))
    assert_close(batch.advantages_BT[:, -1], torch.tensor([S, -S, S, -S]))


def topk_samples():
    """A group of three, all rewards 1: two with a synthetic teacher top-3 on every sampled
    token t = 3, 4, 5 (ids t, t + 1, t + 2, the teacher putting 0.5, 0.25, 0.125 on them; zeros
    on the prompt, as the teacher writes them), one without a teacher."""
    lps = [math.log(0.5), math.log(0.25), math.log(0.125)]
    out = []
    for i in range(3):
        s = make_sample(prompt_len=3, completion_len=3, reward=1.0, logprob=-4.0, seed=i)
        if i < 2:
            s.teacher_logprobs.extend([0.0] * 3 + [-1.0] * 3)
            s.teacher_mask.extend([0] * 3 + [1] * 3)
            s.teacher_topk = 3
            s.teacher_topk_ids.extend([0] * 9 + [t + j for t in (3, 4, 5) for j in range(3)])
            s.teacher_topk_logprobs.extend([0.0] * 9 + lps * 3)
        out.append(s)
    return [out]


def test_student_is_gathered_at_the_teacher_ids_from_the_same_logits():
    model = tiny_model(seed=3)
    cfg = step_config(regularizers={"distill_topk": 1.0})
    batch, _ = prepare_batch(topk_samples(), cfg)
    out = pipeline.student_topk(model, batch, cfg)
    assert out.topk_BTK is None  # SimKO / Lp-Reg not selected: no own top-k
    logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    full = torch.log_softmax(logits[0, 3].float() / batch.temperature_B[0], dim=-1)
    assert_close(out.at_teacher_BTK[0, 4], full[4:7])  # token 4: ids 4, 5, 6, from position 3
    assert out.at_teacher_BTK.requires_grad
    absent = torch.full((3, 3), TOPK_ABSENT)
    assert_close(out.at_teacher_BTK.detach()[0, :3], absent)  # prompt: no teacher top-k
    assert_close(out.at_teacher_BTK.detach()[2], torch.full((6, 3), TOPK_ABSENT))  # no teacher


def test_distill_topk_term_through_the_step_matches_the_binned_kl():
    # token 5 of row 1: reverse KL over bins {ids 5, 6, 7, tail}: q = (0.5, 0.25, 0.125,
    # 0.125), pi = (p5, p6, p7, 1 - p5 - p6 - p7) from the student's full distribution at
    # position 4; term = sum pi (log pi - log q). 0 on the sample without a teacher and on the
    # prompt.
    model = tiny_model(seed=3)
    cfg = step_config(regularizers={"distill_topk": 1.0})
    batch, _ = prepare_batch(topk_samples(), cfg)
    lp = selected_token_logprobs(
        model,
        batch.input_ids_BT,
        batch.attention_mask_BT,
        batch.temperature_B,
        batch.loss_mask_BT,
        chunk_tokens=4,
    )
    term_BT, stats = pipeline.token_terms(
        cfg.algo, lp, batch, pipeline.student_topk(model, batch, cfg)
    )
    logits = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    p = torch.softmax(logits[1, 4].detach().double(), dim=-1)[5:8]
    pi = torch.cat([p, 1 - p.sum(dim=0, keepdim=True)])
    q = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    expected = float((pi * (pi / q).log()).sum())
    assert float(term_BT.detach()[1, 5]) == pytest.approx(expected, rel=1e-4)
    assert float(term_BT.detach()[2].abs().sum()) == 0.0
    assert float(term_BT.detach()[:, :3].abs().sum()) == 0.0
    assert "reg/distill_topk" in stats


def test_distill_topk_train_step_moves_the_student_toward_the_teacher():
    # all rewards equal: GRPO advantages are 0, so the only gradient is the distillation term
    cfg = step_config(regularizers={"distill_topk": 1.0})
    model = tiny_model(seed=3)
    opt = build_optimizer(model, OptimSettings(lr=3e-2))
    batch, _ = prepare_batch(topk_samples(), cfg)

    def kl() -> float:
        with torch.no_grad():
            lp = selected_token_logprobs(
                model,
                batch.input_ids_BT,
                batch.attention_mask_BT,
                batch.temperature_B,
                batch.loss_mask_BT,
            )
            term_BT, _ = pipeline.token_terms(
                cfg.algo, lp, batch, pipeline.student_topk(model, batch, cfg)
            )
        return float(term_BT.sum())

    before = kl()
    for _ in range(3):
        result = train_step(model, opt, batch, cfg)
        assert result.skipped == "" and result.metrics["loss/reg"] > 0
    assert kl() < before


def test_distill_topk_gradient_accumulation_equals_one_big_batch():
    grads = []
    for micro in (8, 1):
        model = tiny_model(seed=2)
        cfg = replaced(
            step_config(regularizers={"distill_topk": 1.0}), batch={"micro_batch_size": micro}
        )
        batch, _ = prepare_batch(topk_samples(), cfg)
        accumulate(model, batch, cfg, normalizer_for(batch.loss_mask_BT))
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_the_full_vocabulary_pass_runs_for_either_top_k_input():
    # `needs_topk` (what the step checks, e.g. to refuse parts with their own forward under
    # fsdp2) covers distill_topk too; the pass computes only what is read
    topk = AlgoConfig(AlgorithmSettings(regularizers={"distill_topk": 1.0}))
    own = AlgoConfig(AlgorithmSettings(regularizers={"lp_reg": 1.0}))
    assert topk.needs_topk and topk.needs_teacher_topk and not topk.needs_own_topk
    assert own.needs_topk and own.needs_own_topk and not own.needs_teacher_topk
    assert not AlgoConfig(AlgorithmSettings(regularizers={"k3": 1.0})).needs_topk


def test_distill_topk_without_any_teacher_top_k_adds_exactly_zero():
    # no sample carries a top-k: K = 0, every position falls in the tail bin on both sides
    # (q_tail = pi_tail = 1), so KL = 1 * (log 1 - log 1) = 0 and the step still commits
    cfg = step_config(regularizers={"distill_topk": 1.0})
    model = tiny_model(seed=3)
    batch, _ = prepare_batch(
        [[make_sample(reward=r, seed=i) for i, r in enumerate([1.0, 0.0])]], cfg
    )
    assert batch.teacher_topk_logprobs_BTK.shape[-1] == 0
    result = train_step(model, build_optimizer(model, OptimSettings()), batch, cfg)
    assert result.skipped == "" and result.metrics["loss/reg"] == 0.0


def test_teacher_ids_outside_the_student_vocabulary_are_left_out():
    # a teacher with a larger vocabulary may name ids the student lacks (VOCAB = 128): that slot
    # is absent on both sides (no out-of-range gather), the others are gathered as usual
    samples = topk_samples()
    samples[0][0].teacher_topk_ids[3 * 3 + 1] = 10_000  # position 3, slot 1
    model = tiny_model(seed=3)
    cfg = step_config(regularizers={"distill_topk": 1.0})
    batch, _ = prepare_batch(samples, cfg)
    out = pipeline.student_topk(model, batch, cfg)
    assert float(out.at_teacher_BTK.detach()[0, 3, 1]) < TOPK_ABSENT / 2  # absent (float32)
    assert float(out.teacher_BTK[0, 3, 1]) < TOPK_ABSENT / 2
    assert float(out.at_teacher_BTK.detach()[0, 3, 0]) > TOPK_ABSENT / 2
