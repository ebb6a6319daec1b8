"""One Sample through the teacher pipeline (fake scorer, real tokenizer and codec)."""

from __future__ import annotations

import pytest

from flywheel.core.codec import decode_sample, encode_sample
from flywheel.core.errors import UpstreamError
from flywheel.teacher.pipeline import Teacher, TeacherConfig
from flywheel.teacher.vocab import VocabularyMismatchError

from .teacher_fakes import FakeScorer, live_sample


def teacher(renderer, scorer, **kw):
    return Teacher(scorer, renderer, TeacherConfig(model_name="teach", **kw))


def test_a_hinted_turn_gets_teacher_logprobs_exactly_on_its_sampled_tokens(renderer):
    sample = live_sample(renderer, task={"hint": "The answer is 8."})
    scorer = FakeScorer()
    out = teacher(renderer, scorer).process(sample)
    mask = list(out.loss_mask)
    start = mask.index(1)
    ((prompt_ids, response_ids, _),) = scorer.calls
    assert response_ids == list(out.token_ids[start:])  # the exact sampled ids
    assert "[Hindsight hint]\nThe answer is 8." in renderer.tokenizer.decode(prompt_ids)
    assert list(out.teacher_mask) == mask
    n_resp = len(mask) - start
    assert list(out.teacher_logprobs) == pytest.approx(
        [0.0] * start + [-0.1 * (i + 1) for i in range(n_resp)]
    )
    assert (out.hint, out.teacher_model, out.teacher_weight_version, out.teacher_status) == (
        "The answer is 8.",
        "teach",
        "5",
        "scored",
    )
    assert decode_sample(encode_sample(out)).teacher_status == "scored"  # codec invariants


def test_only_the_last_segment_is_scored(renderer):
    sample = live_sample(renderer, task={"hint": "The answer is 8."}, segments=2)
    out = teacher(renderer, FakeScorer()).process(sample)
    mask = list(out.loss_mask)
    last_start = len(mask) - mask[::-1].index(0)
    expected = [0] * last_start + [1] * (len(mask) - last_start)
    assert list(out.teacher_mask) == expected and sum(mask) > sum(expected)


def test_top_k_is_stored_k_per_token_at_the_response_positions(renderer):
    sample = live_sample(renderer, task={"hint": "The answer is 8."})
    out = teacher(renderer, FakeScorer(), top_k=2).process(sample)
    n, start = len(out.token_ids), list(out.loss_mask).index(1)
    assert out.teacher_topk == 2 and len(out.teacher_topk_ids) == 2 * n
    assert list(out.teacher_topk_ids[: 2 * start]) == [0] * 2 * start
    assert list(out.teacher_topk_ids[2 * start : 2 * start + 2]) == [10, 11]
    assert list(out.teacher_topk_logprobs[2 * start : 2 * start + 2]) == [0.0, -1.0]
    encode_sample(out)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_samples_at_another_temperature_are_skipped_not_mixed(renderer, temperature):
    scorer = FakeScorer()
    sample = live_sample(renderer, temperature=temperature, task={"hint": "The answer is 8."})
    out = teacher(renderer, scorer).process(sample)
    assert out.teacher_status.startswith(f"skipped: sampled at temperature {temperature:g}")
    assert scorer.calls == [] and set(out.teacher_mask) == {0}
    assert len(out.teacher_logprobs) == len(out.token_ids)


def test_greedy_samples_are_scored(renderer):
    sample = live_sample(renderer, temperature=0.0, task={"hint": "The answer is 8."})
    assert teacher(renderer, FakeScorer()).process(sample).teacher_status == "scored"


def test_no_hint_is_recorded_or_scored_unhinted_by_setting(renderer):
    scorer = FakeScorer()
    out = teacher(renderer, scorer).process(live_sample(renderer))
    assert (out.teacher_status, out.hint, set(out.teacher_mask)) == ("no_hint", "", {0})
    assert scorer.calls == []
    out = teacher(renderer, scorer, require_hint=False).process(live_sample(renderer))
    assert out.teacher_status == "scored" and sum(out.teacher_mask) > 0
    assert "[Hindsight hint]" not in renderer.tokenizer.decode(scorer.calls[0][0])


def test_privileged_context_goes_in_as_a_system_note(renderer):
    scorer = FakeScorer()
    sample = live_sample(renderer, task={"privileged_context": "Reference: 7 + 1 = 8"})
    out = teacher(renderer, scorer, placement="system_note").process(sample)
    text = renderer.tokenizer.decode(scorer.calls[0][0])
    assert text.startswith("<|im_start|>system\n[Privileged context]\nReference: 7 + 1 = 8")
    assert out.hint == "" and out.teacher_status == "scored"


def test_foreign_ids_are_refused(renderer):
    sample = live_sample(renderer, task={"hint": "The answer is 8."})
    sample.token_ids[-1] = renderer.vocab_size + 5
    with pytest.raises(VocabularyMismatchError):
        teacher(renderer, FakeScorer()).process(sample)


def test_engine_outage_propagates(renderer):
    sample = live_sample(renderer, task={"hint": "The answer is 8."})
    with pytest.raises(UpstreamError):
        teacher(renderer, FakeScorer(fail=UpstreamError("down"))).process(sample)


def test_reprocessing_a_redelivered_sample_gives_the_same_fields(renderer):
    t = teacher(renderer, FakeScorer(), top_k=2)
    once = t.process(live_sample(renderer, task={"hint": "The answer is 8."}))
    again = t.process(decode_sample(encode_sample(once)))
    assert encode_sample(again) == encode_sample(once)


def test_a_wrong_hint_is_scored_too_for_contrastive_self_distillation(renderer):
    # Fake teacher logprob of response token i = -0.1 (i + 1) - 0.001 len(prompt ids), so the
    # two contexts (hints of different lengths) give different, predictable values.
    scorer = FakeScorer(offset=lambda prompt_ids: -0.001 * len(prompt_ids))
    sample = live_sample(
        renderer, task={"hint": "The answer is 8.", "wrong_hint": "The answer is 9, so say 9."}
    )
    out = teacher(renderer, scorer).process(sample)
    (right_p, resp, _), (wrong_p, resp2, _) = scorer.calls
    assert resp == resp2
    assert "[Hindsight hint]\nThe answer is 9, so say 9." in renderer.tokenizer.decode(wrong_p)
    start = list(out.loss_mask).index(1)
    n_resp = len(out.token_ids) - start
    assert out.wrong_hint == "The answer is 9, so say 9."
    assert list(out.wrong_hint_logprobs) == pytest.approx(
        [0.0] * start + [-0.1 * (i + 1) - 0.001 * len(wrong_p) for i in range(n_resp)]
    )
    assert list(out.teacher_logprobs[start:]) == pytest.approx(
        [-0.1 * (i + 1) - 0.001 * len(right_p) for i in range(n_resp)]
    )
    assert decode_sample(encode_sample(out)).wrong_hint == out.wrong_hint
    # Without a correct hint there is nothing to contrast: no second pass.
    plain = live_sample(renderer, task={"wrong_hint": "The answer is 9."})
    out = teacher(renderer, FakeScorer(), require_hint=False).process(plain)
    assert out.wrong_hint == "" and len(out.wrong_hint_logprobs) == 0


def test_the_codec_refuses_misaligned_wrong_hint_logprobs(renderer):
    from flywheel.core.errors import ContractError

    sample = live_sample(renderer)
    sample.wrong_hint_logprobs.extend([0.0] * (len(sample.token_ids) - 1))
    with pytest.raises(ContractError, match="wrong_hint_logprobs"):
        encode_sample(sample)
