"""Field failures in the gateway's area (docs/failure-cases.md, CPU tier), each with
the correct behaviour as its expectation. Token ids come from the tokenizer under test."""

import json

import openai
import pytest
from prometheus_client import REGISTRY

from flywheel.core.errors import UpstreamError
from flywheel.gateway.engines.generation import Generation, parse_generation
from flywheel.gateway.recording.history import FORKS, prepare_prompt, record_reply, sampled_reply
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.render.tokenization import ChatRenderer

from .field_failure_support import EOS, SAMPLING, run_episode, scripted_app
from .field_failure_support import make_gen as _gen


def _record(record, gen, sampling, reply):
    """Record `gen` as the session's next turn, as a turn does (one SampledReply)."""
    record_reply(record, sampled_reply(gen, reply), sampling)


# A Qwen3-style ChatML template written for these tests: the latest assistant turn (after the
# last user message) keeps a <think> block, earlier ones lose it; consecutive tool results are
# merged into ONE user turn of <tool_response> blocks; tool calls render as <tool_call> JSON.
QWEN_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role in ['system', 'user'] -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ content }}"
    "{%- for call in m.tool_calls or [] -%}"
    '{{ \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ call.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture(scope="module")
def qwen_like(smollm2_dir, tmp_path_factory):
    base = ChatRenderer(smollm2_dir)
    base.tokenizer.chat_template = QWEN_LIKE
    folder = tmp_path_factory.mktemp("qwen_like_tokenizer")
    base.tokenizer.save_pretrained(folder)
    return ChatRenderer(folder)


def _turn(record, renderer, messages, ids, text, tools=None):
    prompt, closed = prepare_prompt(record, renderer, messages, tools)
    reply = {"role": "assistant", "content": text}
    _record(record, _gen(ids, text), SAMPLING, reply)
    return prompt, closed, reply


# BUG-01: decode -> re-encode between turns changes token ids.
def test_bug01_non_canonical_split_is_kept_exactly(renderer):
    word = " hello"
    canon = renderer.encode(word)
    sampled = renderer.encode(" hel") + renderer.encode("lo")
    assert len(canon) == 1 and sampled != canon and renderer.decode(sampled) == word
    record = SessionRecord(session_id="b01")
    m1 = [{"role": "user", "content": "say hello"}]
    prompt1, _, reply = _turn(record, renderer, m1, sampled + [EOS], word)
    m2 = [*m1, reply, {"role": "user", "content": "again"}]
    prompt2, closed = prepare_prompt(record, renderer, m2, None)
    assert closed is None and record.forks == 0
    assert prompt2[: len(prompt1) + len(sampled) + 1] == prompt1 + sampled + [EOS]
    assert record.segment.loss_mask[len(prompt1) : len(prompt1) + len(sampled) + 1] == [1] * 3


def test_bug01_special_token_sampled_mid_reply_stays_in_the_ids(renderer):
    special = renderer.tokenizer.convert_tokens_to_ids("<|im_start|>")
    sampled = renderer.encode("A") + [special] + renderer.encode("B") + [EOS]
    assert renderer.decode(sampled) == "AB"
    record = SessionRecord(session_id="b01s")
    m1 = [{"role": "user", "content": "letters"}]
    prompt1, _, reply = _turn(record, renderer, m1, sampled, "AB")
    prompt2, _ = prepare_prompt(
        record, renderer, [*m1, reply, {"role": "user", "content": "x"}], None
    )
    assert prompt2[len(prompt1) : len(prompt1) + len(sampled)] == sampled


def test_bug01_edited_echo_is_never_trained_with_old_logprobs(renderer):
    record = SessionRecord(session_id="b01e")
    m1 = [{"role": "user", "content": "say hello"}]
    sampled = renderer.encode(" hello") + [EOS]
    _turn(record, renderer, m1, sampled, " hello")
    before = FORKS.labels("assistant_edited")._value.get()
    edited = [*m1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    prompt, closed = prepare_prompt(record, renderer, edited, None)
    assert closed is not None and closed.sampled_tokens == len(sampled)
    assert record.segment.loss_mask == [0] * len(prompt)  # the edited echo is context only
    assert record.fork_reasons == {"assistant_edited": 1}
    assert FORKS.labels("assistant_edited")._value.get() == before + 1


# BUG-02: a template that strips <think> from history: turns are not token prefixes.
@pytest.mark.parametrize(
    "content", ["<think>\nuser greets me\n</think>\n\nI am good!", "I am good!"]
)
def test_bug02_template_dropping_reasoning_forks_instead_of_splicing(qwen_like, content):
    msgs = [
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "What is your name?"},
    ]
    two = qwen_like.render(msgs[:2], add_generation_prompt=False)
    three = qwen_like.render(msgs, add_generation_prompt=False)
    reasoning = "user greets me" if "<think>" in content else ""
    assert two.endswith(
        f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\nI am good!<|im_end|>\n"
    )
    assert "<|im_start|>assistant\nI am good!<|im_end|>" in three
    record = SessionRecord(session_id="b02")
    # The engine sampled the reasoning block and the answer after the generation prompt.
    sampled_text = f"<think>\n{reasoning}\n</think>\n\nI am good!"
    sampled = qwen_like.encode(sampled_text) + [EOS]
    prompt1, _ = prepare_prompt(record, qwen_like, msgs[:1], None)
    _record(
        record, _gen(sampled, sampled_text), SAMPLING, {"role": "assistant", "content": content}
    )
    prompt2, closed = prepare_prompt(record, qwen_like, msgs, None)
    assert record.fork_reasons == {"template_rewrites_history": 1}
    assert closed is not None and closed.token_ids == prompt1 + sampled
    assert sum(closed.loss_mask) == len(sampled)
    # The new segment renders the rewritten history as context: no token keeps an old logprob.
    assert prompt2 == qwen_like.prompt_ids(msgs)
    assert record.segment.loss_mask == [0] * len(prompt2)
    assert set(record.segment.logprobs) == {0.0}


# BUG-04: consecutive tool results render as ONE user turn, exactly as the template does.
def test_bug04_parallel_tool_results_are_one_observation(qwen_like):
    calls = [
        {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"path": p})},
        }
        for i, p in ((1, "a.py"), (2, "b.py"))
    ]
    user = {"role": "user", "content": "show a.py and b.py"}
    reply = {"role": "assistant", "content": "", "tool_calls": calls}
    tools = [
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "c2", "content": "print(2)"},
    ]
    record = SessionRecord(session_id="b04")
    prompt1, _ = prepare_prompt(record, qwen_like, [user], None)
    said = qwen_like.render([user, reply], add_generation_prompt=False)[
        len(qwen_like.render([user])) :
    ]
    sampled = qwen_like.encode(said.removesuffix("<|im_end|>\n")) + [EOS]
    _record(record, _gen(sampled, said), SAMPLING, reply)
    prompt2, closed = prepare_prompt(record, qwen_like, [user, reply, *tools], None)
    assert closed is None
    observation = prompt2[len(prompt1) + len(sampled) :]
    text = qwen_like.tokenizer.decode(observation)
    full = qwen_like.render([user, reply, *tools])
    assert full.endswith(text) and text.count("<|im_start|>user") == 1
    assert "print(1)\n</tool_response><|im_end|>" not in text
    assert "print(1)\n</tool_response>\n<tool_response>\nprint(2)" in text
    assert record.segment.loss_mask[-len(observation) :] == [0] * len(observation)
    assert qwen_like.tokenizer.decode(prompt2) == full


@pytest.fixture
def app(redis_client, prefix, renderer):
    return scripted_app(redis_client, prefix, renderer)


TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


_episode = run_episode


# BUG-06: streaming with a tool parser keeps every sampled id (tool-call tokens included).
def test_bug06_streamed_tool_call_records_the_same_ids_as_non_streamed(app, renderer):
    client, use, samples = app
    ids = renderer.encode(TWO_CALLS) + [EOS]
    use(_gen(ids, TWO_CALLS))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather and time?"}],
        "tools": TOOLS,
        "logprobs": True,
        "top_logprobs": 0,
    }
    plain, s_plain = _episode(client, body, samples)
    streamed, s_stream = _episode(client, {**body, "stream": True}, samples)
    assert "data: [DONE]" in streamed.text
    n = len(ids)
    assert list(s_stream.token_ids) == list(s_plain.token_ids)
    assert list(s_stream.token_ids[-n:]) == ids  # <tool_call>, the JSON, </tool_call>, EOS
    assert list(s_stream.loss_mask[-n:]) == [1] * n
    assert len(s_stream.rollout_logprobs) == len(s_stream.token_ids)
    assert s_stream.finish_reason == "tool_calls"
    # Logprobs stay on with the tool parser, streamed or not: one row per sampled token, the
    # engine's logprob (-0.5 from `_gen`), the same rows in both forms.
    whole = plain.json()["choices"][0]["logprobs"]["content"]
    assert [row["logprob"] for row in whole] == [-0.5] * n
    events = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    rows = [
        row
        for e in events
        for c in e["choices"]
        if c.get("logprobs")
        for row in c["logprobs"]["content"]
    ]
    assert rows == whole


# BUG-27: streamed tool-call deltas carry an index; the SDK stream helper consumes them.
def test_bug27_sdk_stream_helper_accumulates_both_parallel_calls(app, renderer):
    client, use, _ = app
    use(_gen(renderer.encode(TWO_CALLS) + [EOS], TWO_CALLS))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client)
    messages = [{"role": "user", "content": "weather and time?"}]
    with sdk.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as stream:
        deltas = [e for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    indexes = [
        tc.index for e in deltas for c in e.chunk.choices for tc in (c.delta.tool_calls or [])
    ]
    assert indexes == [0, 1]
    streamed = [
        (c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls
    ]
    whole = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert streamed == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert streamed == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert final.choices[0].finish_reason == "tool_calls"


# BUG-07 / BUG-08: the Sample stores the sampling params the engine used (T, top_p, top_k).
def test_bug07_08_sampling_params_are_stored_with_the_sample(app, renderer):
    client, use, samples = app
    engine = use(_gen(renderer.encode("8") + [EOS], "8"))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "7+1?"}],
        "temperature": 0.6,
        "top_p": 0.75,
        "top_k": 20,
        "max_completion_tokens": 9,
    }
    _, sample = _episode(client, body, samples)
    sent = engine.calls[0][1]
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (0.6, 0.75, 20)
    s = sample.sampling
    assert (round(s.temperature, 6), s.top_p, s.top_k, s.max_new_tokens) == (0.6, 0.75, 20, 9)


# BUG-10: an engine that ran past a stop (speculative decoding) is cut at the stop: the ids up
# to the token that completes it are served and recorded, finish "stop", the overrun counted.
def _overruns(kind):
    return REGISTRY.get_sample_value("flywheel_gateway_stop_overruns_total", {"kind": kind}) or 0


def _sampled(client, sid):
    info = client.get(f"/v1/sessions/{sid}").json()
    return [t for t, m in zip(info["token_ids"], info["loss_mask"], strict=True) if m]


def test_bug10_tokens_after_a_stop_string_are_cut_off(app, renderer):
    client, use, samples = app
    kept = renderer.encode("1, 2 ha ha ha")
    before = _overruns("tokens_after_stop")
    use(_gen(kept + renderer.encode(" more"), "1, 2", matched=" ha ha ha"))
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    resp = client.post(
        f"/s/{sid}/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "count"}],
            "stop": [" ha ha ha"],
            "logprobs": True,
        },
    )
    choice = resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "1, 2")
    assert len(choice["logprobs"]["content"]) == len(kept)
    assert _sampled(client, sid) == kept
    assert _overruns("tokens_after_stop") == before + 1


def test_bug10_stop_token_inside_a_length_finish_is_cut_there(app, renderer):
    client, use, samples = app
    # The case's example: one accepted block [10, 11, STOP, 20, 21] crossed the 5-token cap.
    use(_gen([10, 11, EOS, 20, 21], "x", finish="length", matched=None))
    resp, sample = _episode(
        client,
        {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 5},
        samples,
    )
    assert resp.json()["choices"][0]["finish_reason"] == "stop"
    n = sample.prompt_length
    assert list(sample.token_ids[n:]) == [10, 11, EOS]
    assert list(sample.loss_mask[n:]) == [1, 1, 1]
    assert list(sample.rollout_logprobs[n:]) == [-0.5] * 3
    assert sample.finish_reason == "stop"


def test_bug10_length_on_the_token_that_completes_a_stop_is_stop(app, renderer):
    client, use, samples = app
    ids = renderer.encode("1, 2 ha ha ha")
    before = _overruns("finish_relabelled")
    use(_gen(ids, "1, 2 ha ha ha", finish="length", matched=None))  # text not trimmed either
    resp, sample = _episode(
        client,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "count"}],
            "stop": " ha ha ha",
            "max_tokens": len(ids),
        },
        samples,
    )
    choice = resp.json()["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "1, 2")
    assert list(sample.token_ids[sample.prompt_length :]) == ids  # nothing cut
    assert _overruns("finish_relabelled") == before + 1


def test_bug10_logprob_rows_must_match_output_ids():
    body = {
        "output_ids": [5, 6, 7],
        "text": "x",
        "meta_info": {
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
            "finish_reason": {"type": "length"},
        },
    }
    with pytest.raises(UpstreamError):
        parse_generation(body, {EOS})


# BUG-11: truncation by the token cap is "length", never "stop".
@pytest.mark.parametrize(
    ("text", "finish", "content", "reasoning"),
    [
        ("1, 2, 3", "length", "1, 2, 3", None),
        ("<think>\nlet me think about all of", "length", "", "let me think about all of"),
        ("1, 2", "stop", "1, 2", None),  # (b) a stop completed on the last allowed token
    ],
)
def test_bug11_finish_reason_length_vs_stop(app, renderer, text, finish, content, reasoning):
    client, use, samples = app
    ids = renderer.encode(text)[:5]
    use(_gen(ids, text, finish=finish, matched=None))
    resp, sample = _episode(
        client,
        {"model": "m", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 5},
        samples,
    )
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == finish and sample.finish_reason == finish
    assert choice["message"]["content"] == content
    assert choice["message"].get("reasoning_content") == reasoning
    assert resp.json()["usage"]["completion_tokens"] == len(ids) <= 5


# BUG-30: request fields are honored, refused with a 400 naming them, or documented no-ops.
def test_bug30_request_field_policy(app, renderer):
    client, use, _ = app
    engine = use(_gen(renderer.encode("ok") + [EOS], "ok"))
    msgs = [{"role": "user", "content": "Write a long story."}]

    def post(**body):
        return client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, **body})

    assert post(max_completion_tokens=5).status_code == 200
    assert engine.calls[-1][1]["max_new_tokens"] == 5
    assert post(max_tokens=5, max_completion_tokens=5).status_code == 200  # (a)
    conflict = post(max_tokens=5, max_completion_tokens=50)  # (b)
    message = conflict.json()["error"]["message"]
    assert conflict.status_code == 400 and "max_tokens" in message
    assert "max_completion_tokens" in message
    nulls = post(logprobs=True, top_logprobs=None)  # (c)
    assert nulls.status_code == 200
    assert len(nulls.json()["choices"][0]["logprobs"]["content"]) == 2
    foo = post(foo=1)  # (d)
    assert foo.status_code == 400 and foo.json()["error"]["param"] == "foo"
    post(stop="END")
    as_string = engine.calls[-1][1]
    post(stop=["END"])
    assert engine.calls[-1][1] == as_string  # (e)
    penalty = post(presence_penalty=0.5)
    assert penalty.status_code == 400 and penalty.json()["error"]["param"] == "presence_penalty"
    assert post(presence_penalty=0, frequency_penalty=0.0, logit_bias={}).status_code == 200
    fmt = post(response_format={"type": "xml"})
    assert fmt.status_code == 400 and fmt.json()["error"]["param"] == "response_format"
    tops = post(top_logprobs=3)  # (f) alternatives asked for without logprobs: not dropped
    assert tops.status_code == 400 and "needs logprobs: true" in tops.json()["error"]["message"]
    assert post(logprobs=False, top_logprobs=0).status_code == 200  # zero alternatives: valid


def test_top_logprobs_are_asked_of_the_engine_and_returned(app, renderer):
    client, use, _ = app
    ids = renderer.encode("ok") + [EOS]
    gen = _gen(ids, "ok")
    tops = [[(-0.1, t), (-2.5, 42)] for t in ids]
    engine = use(Generation(**{**gen.__dict__, "output_top_logprobs": tops}))
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert engine.calls[-1][2] == 2
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [[e["logprob"] for e in c["top_logprobs"]] for c in content] == [[-0.1, -2.5]] * len(ids)
    assert content[0]["top_logprobs"][1]["token"] == renderer.tokenizer.decode([42])


def test_reformatted_arguments_fork_when_the_template_renders_them_raw(qwen_like):
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "read", "arguments": '{"path": "a.py"}'},
    }
    user = {"role": "user", "content": "show a.py"}
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    record = SessionRecord(session_id="args")
    prepare_prompt(record, qwen_like, [user], tools)
    said = qwen_like.render([user, reply], add_generation_prompt=False)[
        len(qwen_like.render([user])) :
    ]
    _record(
        record,
        _gen(qwen_like.encode(said.removesuffix("<|im_end|>\n")) + [EOS], said),
        SAMPLING,
        reply,
    )
    compact = {
        **reply,
        "tool_calls": [{**call, "function": {"name": "read", "arguments": '{"path":"a.py"}'}}],
    }
    tool = {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}
    _, closed = prepare_prompt(record, qwen_like, [user, compact, tool], tools)
    assert closed is not None
    assert record.fork_reasons == {"tool_arguments_reformatted": 1}


def test_bug10_eos_as_the_last_allowed_token_is_a_stop_and_stitches_once(app, renderer):
    # SGLang checks the token cap before the stop tokens: an EOS sampled as the last allowed
    # token finishes "length". The turn ended on its EOS all the same, so the next turn's
    # prompt is exactly a fresh rendering of the conversation (one end-of-turn, not two).
    client, use, samples = app
    ids = renderer.encode("8") + [EOS]
    use(_gen(ids, "8", finish="length", matched=None))
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    first = [{"role": "user", "content": "7 + 1?"}]
    resp = client.post(
        f"/s/{sid}/v1/chat/completions",
        json={"model": "m", "messages": first, "max_tokens": len(ids)},
    )
    assert resp.json()["choices"][0]["finish_reason"] == "stop"
    then = [*first, {"role": "assistant", "content": "8"}, {"role": "user", "content": "+1?"}]
    client.post(f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": then})
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["forks"] == 0
    assert info["token_ids"][: -len(ids)] == renderer.prompt_ids(then)
