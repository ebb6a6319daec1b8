"""Grammar-renormalised logprobs (docs/token-path.md, "Constrained tokens"): the gateway tells
them from the engine's answer, keeps them as spans of the segment (also across a save to real
Redis) and marks their tokens in `Sample.logprob_renormalized`."""

from __future__ import annotations

import asyncio

import pytest

from flywheel.core.codec import decode_sample, encode_sample, validate_sample
from flywheel.core.errors import ContractError
from flywheel.gateway.engines.generation import Generation, parse_generation
from flywheel.gateway.recording.history import record_reply, sampled_reply
from flywheel.gateway.recording.records import Segment, SessionRecord
from flywheel.gateway.recording.sample import build_sample
from flywheel.gateway.session import locks
from flywheel.gateway.session.store import SessionStore

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 16}
SCHEMA = {**SAMPLING, "json_schema": '{"type": "object"}'}


def _answer(**meta) -> dict:
    """A /generate answer of two tokens, as SGLang 0.5.23 writes it (plus `meta`)."""
    return {
        "text": "{}",
        "output_ids": [90, 92],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "3",
            "prompt_tokens": 4,
            "output_token_logprobs": [[-0.25, 90, None], [-0.5, 92, None]],
            **meta,
        },
    }


@pytest.mark.parametrize(
    ("meta", "sampling", "renormalized"),
    [
        ({}, SCHEMA, True),  # SGLang under a grammar: masked before its log-softmax
        ({"grammar_logprobs": "unmasked"}, SCHEMA, False),  # the embedded engine says so
        ({}, SAMPLING, False),  # no grammar: nothing to renormalise over
        ({}, {**SAMPLING, "structural_tag": "{}"}, True),
        ({}, {**SAMPLING, "regex": ""}, False),  # an empty param is no grammar
        ({}, None, False),
    ],
)
def test_an_answer_is_renormalized_when_it_had_a_grammar_and_no_unmasked_note(
    meta, sampling, renormalized
):
    gen = parse_generation(_answer(**meta), {2}, sampling)
    assert gen.renormalized is renormalized
    assert gen.output_logprobs == [-0.25, -0.5]  # the values themselves are kept as reported


def _gen(ids: list[int], renormalized: bool) -> Generation:
    return Generation(
        output_ids=ids,
        output_logprobs=[-0.5] * len(ids),
        text="x",
        finish_type="stop",
        matched_eos=True,
        weight_version=1,
        prompt_tokens=0,
        renormalized=renormalized,
    )


def _two_turns() -> SessionRecord:
    """Prompt ids 0..3, a renormalised turn 4..6, template ids 7..8, a plain turn 9..10."""
    record = SessionRecord(session_id="s")
    seg = record.segment
    seg.append([1, 2, 3, 4], sampled=False)
    seg.prompt_length = 4
    record_reply(record, sampled_reply(_gen([5, 6, 2], True), {"role": "assistant"}), SCHEMA)
    seg.append([7, 8], sampled=False)
    record_reply(record, sampled_reply(_gen([9, 2], False), {"role": "assistant"}), SAMPLING)
    return record


def test_a_renormalised_turn_is_a_span_and_marks_only_its_tokens():
    record = _two_turns()
    seg = record.segment
    assert seg.renormalized == [(4, 7)]
    whole = decode_sample(encode_sample(build_sample(record, seg)))
    assert list(whole.logprob_renormalized) == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert list(whole.loss_mask) == [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # live mode: the Sample of the last (plain) turn marks nothing and carries no array
    last = build_sample(record, seg, turn_only=True)
    assert list(last.logprob_renormalized) == []
    # cut right after the first turn: the span is kept whole; a cut inside it shortens it
    assert seg.upto(0).renormalized == [(4, 7)]
    seg.checkpoints[0].tokens = 6
    assert seg.upto(0).renormalized == [(4, 6)]


def test_spans_survive_a_save_to_redis(redis_client, prefix):
    store = SessionStore(redis_client, prefix, 60)
    store.create(session_id="s")

    async def turn() -> None:
        async with locks.locked(store, "s") as record:
            record.segment.append([1, 2], sampled=False)
            reply = sampled_reply(_gen([5, 6, 2], True), {"role": "assistant"})
            record_reply(record, reply, SCHEMA)

    asyncio.run(turn())
    asyncio.run(turn())
    fresh = SessionStore(redis_client, prefix, 60)  # no cache: read back from Redis
    assert fresh.get("s").segment.renormalized == [(2, 5), (7, 10)]


def test_the_codec_refuses_a_misaligned_or_non_binary_array():
    record = _two_turns()
    sample = build_sample(record, record.segment)
    del sample.logprob_renormalized[-1]
    with pytest.raises(ContractError, match="logprob_renormalized has 10 entries"):
        validate_sample(sample)
    sample.logprob_renormalized.append(2)
    with pytest.raises(ContractError, match="logprob_renormalized values must be 0 or 1"):
        validate_sample(sample)


def test_a_segment_without_spans_reads_as_before():
    # records stored before the field existed have no "renormalized" key
    seg = Segment.model_validate(
        {"token_ids": [1], "loss_mask": [0], "logprobs": [0.0]} | {"versions": [-1]}
    )
    assert seg.renormalized == []
