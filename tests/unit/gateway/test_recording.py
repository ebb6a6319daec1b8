"""Token-faithful recording with the real SmolLM2 tokenizer and chat template."""

import json

import pytest

from flywheel.core.codec import decode_sample, encode_sample
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.recording.history import prepare_prompt, record_reply, sampled_reply
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.recording.sample import build_sample
from flywheel.gateway.render.tokenization import ChatRenderer


def _record(record, gen, sampling, reply):
    """Record `gen` as the session's next turn, as a turn does (one SampledReply)."""
    record_reply(record, sampled_reply(gen, reply), sampling)


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _gen(renderer, text, ids=None, eos=True, version=3):
    ids = ids if ids is not None else renderer.encode(text) + ([2] if eos else [])
    return Generation(
        output_ids=ids,
        output_logprobs=[-0.5] * len(ids),
        text=text,
        finish_type="stop" if eos else "length",
        matched_eos=eos,
        weight_version=version,
        prompt_tokens=0,
    )


def test_first_turn_prompt_is_the_template_rendering(renderer):
    record = SessionRecord(session_id="s")
    messages = [{"role": "user", "content": "What is 7 + 1?"}]
    prompt, closed = prepare_prompt(record, renderer, messages, None)
    expected = renderer.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt == renderer.encode(expected)
    assert closed is None
    assert record.segment.loss_mask == [0] * len(prompt)


def test_second_turn_keeps_sampled_ids_exactly(renderer):
    record = SessionRecord(session_id="s")
    m1 = [{"role": "user", "content": "What is 7 + 1?"}]
    prompt1, _ = prepare_prompt(record, renderer, m1, None)
    # Sampled ids that a re-tokenization of the text would NOT produce: " 8" split oddly.
    odd_ids = renderer.encode(" ") + renderer.encode("8") + [2]
    gen = _gen(renderer, " 8", ids=odd_ids)
    _record(record, gen, SAMPLING, {"role": "assistant", "content": " 8"})
    m2 = [*m1, {"role": "assistant", "content": " 8"}, {"role": "user", "content": "And 2+2?"}]
    prompt2, closed = prepare_prompt(record, renderer, m2, None)
    assert closed is None
    n1 = len(prompt1)
    assert prompt2[:n1] == prompt1
    assert prompt2[n1 : n1 + len(odd_ids)] == odd_ids  # the sampled ids, untouched
    seg = record.segment
    assert seg.loss_mask == [0] * n1 + [1] * len(odd_ids) + [0] * (len(prompt2) - n1 - len(odd_ids))
    assert seg.versions[n1 : n1 + len(odd_ids)] == [3] * len(odd_ids)
    # The suffix is the template's text after the sampled <|im_end|>: "\n<|im_start|>user..."
    suffix_text = renderer.tokenizer.decode(prompt2[n1 + len(odd_ids) :])
    assert suffix_text.startswith("\n<|im_start|>user\nAnd 2+2?<|im_end|>")
    assert suffix_text.endswith("<|im_start|>assistant\n")


def test_edited_history_forks_a_new_segment(renderer):
    record = SessionRecord(session_id="s")
    m1 = [{"role": "user", "content": "Hi"}]
    prepare_prompt(record, renderer, m1, None)
    _record(record, _gen(renderer, "Hello"), SAMPLING, {"role": "assistant", "content": "Hello"})
    edited = [*m1, {"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "x"}]
    prompt, closed = prepare_prompt(record, renderer, edited, None)
    assert closed is not None and closed.index == 0 and closed.sampled_tokens > 0
    assert record.segment.index == 1 and record.forks == 1
    assert prompt == renderer.prompt_ids(edited)


def test_sample_from_segment_satisfies_invariants(renderer):
    record = SessionRecord(session_id="s", group_id="g", task={"answer": 8})
    m1 = [{"role": "user", "content": "What is 7 + 1?"}]
    prompt, _ = prepare_prompt(record, renderer, m1, None)
    gen = _gen(renderer, "8")
    _record(record, gen, SAMPLING, {"role": "assistant", "content": "8"})
    sample = decode_sample(encode_sample(build_sample(record, record.segment, reward=1.0)))
    assert list(sample.token_ids) == prompt + gen.output_ids
    assert sum(sample.loss_mask) == len(gen.output_ids)
    assert sample.prompt_length == len(prompt)
    assert sample.rewards["outcome"] == 1.0
    assert sample.sampling.temperature == 1.0 and sample.sampling.top_k == -1
    assert [m.role for m in sample.messages] == ["user", "assistant"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tools_reach_a_template_that_ignores_them(renderer):
    assert not renderer.renders_tools and not renderer.renders_tool_calls  # SmolLM2's template
    user = [{"role": "user", "content": "Weather in Paris?"}]
    text = renderer.render(user, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    system = [{"role": "system", "content": "Be brief."}, *user]
    merged = renderer.render(system, tools=TOOLS)
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "# Tools" not in renderer.render(user)


def test_reserialized_tool_arguments_still_extend_the_segment(renderer):
    record = SessionRecord(session_id="s")
    m1 = [{"role": "user", "content": "Weather in Paris?"}]
    prompt1, _ = prepare_prompt(record, renderer, m1, TOOLS)
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = _gen(renderer, said)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    _record(record, gen, SAMPLING, {"role": "assistant", "content": None, "tool_calls": [call]})
    compact = {**call, "function": {**call["function"], "arguments": '{"city":"Paris"}'}}
    m2 = [
        *m1,
        {"role": "assistant", "content": "", "tool_calls": [compact]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prompt2, closed = prepare_prompt(record, renderer, m2, TOOLS)
    assert closed is None and record.forks == 0
    assert prompt2[: len(prompt1) + len(gen.output_ids)] == prompt1 + gen.output_ids
    # The history renders the call as the text the model produced.
    assert said in renderer.render(m2, tools=TOOLS)
