"""`POST /v1/responses` in-process (api/responses.py): a scripted streaming engine, the real
SmolLM2 tokenizer and a real Redis; the official `openai` SDK parses the answers and events.

Covers the response object, the event sequence, token faithfulness of output items sent back
(no fork, one segment), `store` + `previous_response_id` (another key's id is a 404), session
keys (`gateway.session_headers`, `prompt_cache_key`) and OpenAI error JSON for bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import openai
import pytest
from fastapi.testclient import TestClient

from flywheel.core.settings import GatewaySettings
from flywheel.gateway.app import create_app
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore

from .harness import gateway_app

EOS = 2  # <|im_end|> of the SmolLM2 tokenizer
TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 1}}\n</tool_call>'


class ScriptEngine:
    """Samples the scripted replies in order, token by token (`on_text` gets each cumulative
    text when streamed); records every prompt."""

    def __init__(self, renderer: ChatRenderer, replies: list[str]):
        self.renderer, self.replies, self.prompts = renderer, list(replies), []

    def _next(self, input_ids: list[int]) -> tuple[str, list[int]]:
        self.prompts.append(list(input_ids))
        text = self.replies.pop(0)
        return text, self.renderer.encode(text) + [EOS]

    def _gen(self, text: str, ids: list[int], n_prompt: int) -> Generation:
        return Generation(
            output_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            text=text,
            finish_type="stop",
            matched=EOS,
            matched_eos=True,
            weight_version=3,
            prompt_tokens=n_prompt,
        )

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        text, ids = self._next(input_ids)
        gen = self._gen(text, ids, len(input_ids))
        if top_logprobs_num:
            gen = dataclasses.replace(gen, output_top_logprobs=[[(-0.5, i)] for i in ids])
        return gen

    async def generate_stream(
        self, input_ids, sampling_params, affinity="", top_logprobs_num=0, *, on_text
    ):
        text, ids = self._next(input_ids)
        for k in range(1, len(ids) + 1):
            on_text(self.renderer.decode(ids[:k]))
            await asyncio.sleep(0.02)
        return self._gen(text, ids, len(input_ids))


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def gw(redis_client, prefix, renderer):
    """(make(replies, **settings) -> (TestClient, engine), samples, deps)."""
    client, deps, samples = gateway_app(redis_client, prefix, renderer, None)

    def make(replies: list[str], **settings) -> tuple[TestClient, ScriptEngine]:
        deps.engines = ScriptEngine(renderer, replies)
        if settings:
            deps.settings = GatewaySettings(**settings)
            return TestClient(create_app(deps)), deps.engines
        return client, deps.engines

    return make, samples, deps


def sdk(client: TestClient, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="k", http_client=client, default_headers=headers
    )


def test_plain_response_is_well_formed_and_echoes_the_request(gw):
    make, _, _ = gw
    client, engine = make(["Eight."])
    r = sdk(client).responses.create(
        model="m", input="What is 7 + 1?", instructions="Be brief.", max_output_tokens=20
    )
    assert r.status == "completed" and r.output_text == "Eight."
    assert r.id.startswith("resp_") and r.instructions == "Be brief."
    (message,) = r.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert r.usage.input_tokens == len(engine.prompts[0])
    assert r.usage.output_tokens == 3  # "Eight", "." and the end-of-turn token
    assert r.usage.total_tokens == r.usage.input_tokens + 3
    assert r.max_output_tokens == 20 and r.tools == []


def test_streamed_events_come_in_order_and_add_up_to_the_recorded_reply(gw):
    make, samples, _ = gw
    text = "Seven plus one is eight, as counting on from seven shows."
    client, _ = make([text])
    events = list(
        sdk(client, **{"X-Session-Id": "st-1"}).responses.create(
            model="m", input="What is 7 + 1?", stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == text  # sent while sampled
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens > 5
    assert client.post("/v1/sessions/st-1/finish", json={}).status_code == 200
    (sample,) = samples()
    assert sample.messages[-1].content_json == f'"{text}"'


def test_function_call_round_trip_extends_the_session_without_a_fork(gw, redis_client, prefix):
    make, samples, _ = gw
    client, engine = make([f"Let me add. {CALL}", "It is 8."])
    api = sdk(client, **{"X-Session-Id": "tools-1"})
    items = [{"role": "user", "content": "What is 7 + 1?"}]
    first = api.responses.create(model="m", input=items, tools=[TOOL], stream=True)
    events = list(first)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    r1 = events[-1].response
    message, call = r1.output
    assert message.content[0].text == "Let me add."
    assert call.type == "function_call" and call.name == "add"
    assert call.arguments == '{"a": 7, "b": 1}' and call.call_id.startswith("call_")
    items += [item.model_dump(exclude_none=True) for item in r1.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "8"})
    r2 = api.responses.create(model="m", input=items, tools=[TOOL])
    assert r2.output_text == "It is 8."
    record = SessionStore(redis_client, prefix, 60).get("tools-1")
    assert record.forks == 0 and record.segment.turns == 2
    # The second prompt starts with the first prompt and its sampled ids, as sampled.
    first_ids = engine.prompts[0] + engine.renderer.encode(f"Let me add. {CALL}") + [EOS]
    assert engine.prompts[1][: len(first_ids)] == first_ids
    client.post("/v1/sessions/tools-1/finish", json={})
    assert [s.turn_index for s in samples()] == [0, 1]


def test_previous_response_id_continues_the_stored_conversation(gw):
    make, _, _ = gw
    client, engine = make([CALL, "It is 8.", "Nine."])
    api = sdk(client, **{"X-Session-Id": "prev-1"})
    r1 = api.responses.create(model="m", input="What is 7 + 1?", tools=[TOOL], instructions="I")
    (call,) = r1.output
    r2 = api.responses.create(
        model="m",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "8"}],
        tools=[TOOL],
        instructions="I",
    )
    assert r2.previous_response_id == r1.id and r2.output_text == "It is 8."
    r3 = api.responses.create(
        model="m", previous_response_id=r2.id, input="And 8 + 1?", instructions="I", tools=[TOOL]
    )
    assert r3.output_text == "Nine."
    assert engine.prompts[2][: len(engine.prompts[1])] == engine.prompts[1]
    info = client.get("/v1/sessions/prev-1").json()
    assert info["forks"] == 0 and info["segment_turns"] == 3  # one segment


def test_store_false_and_unknown_ids_are_404_in_openai_format(gw):
    make, _, _ = gw
    client, _ = make(["a", "b"])
    api = sdk(client)
    r1 = api.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError) as err:
        api.responses.create(model="m", input="y", previous_response_id=r1.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["type"] == "not_found_error"


def test_another_keys_response_is_a_404(gw, redis_client, prefix):
    from flywheel.gateway.api.responses_store import ResponseStore, StoredResponse

    make, _, _ = gw
    client, _ = make(["a"])
    store = ResponseStore(redis_client, prefix, 60)
    asyncio.run(store.put("resp_0123", StoredResponse("other-key", "", [])))
    assert asyncio.run(store.get("resp_0123", "other-key")).owner == "other-key"
    reply = client.post(
        "/v1/responses", json={"model": "m", "input": "y", "previous_response_id": "resp_0123"}
    )
    assert reply.status_code == 404, reply.text


def test_retrieve_and_delete_a_stored_response_through_the_sdk(gw):
    make, _, _ = gw
    client, _ = make(["Eight.", "Nine.", "Ten."])
    api = sdk(client)
    made = api.responses.create(model="m", input="What is 7 + 1?", metadata={"k": "v"})
    got = api.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()  # the object as it was answered
    assert got.output_text == "Eight." and got.metadata == {"k": "v"}
    # the session form answers the same (a client whose base URL is /s/<id>/v1)
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    assert client.get(f"/s/{sid}/v1/responses/{made.id}").json() == got.model_dump(
        mode="json", exclude_unset=True
    )

    api.responses.delete(made.id)
    for call in (api.responses.retrieve, api.responses.delete):
        with pytest.raises(openai.NotFoundError) as err:
            call(made.id)
        assert err.value.body["type"] == "not_found_error", err.value.body
        assert made.id in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:  # a deleted response has no successor
        api.responses.create(model="m", input="y", previous_response_id=made.id)
    assert err.value.body["param"] == "previous_response_id"

    unstored = api.responses.create(model="m", input="z", store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    assert client.delete("/v1/responses/resp_missing").json()["error"]["type"] == (
        "not_found_error"
    )


def test_a_trailing_assistant_item_is_history_not_a_prefill(gw, renderer):
    """The Responses API has no prefill: the reply is a new assistant turn after it."""
    make, _, _ = gw
    client, engine = make(["Eight."])
    r = sdk(client).responses.create(
        model="m",
        input=[
            {"role": "user", "content": "What is 7 + 1?"},
            {"role": "assistant", "content": "Let me think"},
        ],
    )
    assert r.output_text == "Eight."  # not "Let me think" + anything
    prompt = renderer.tokenizer.decode(engine.prompts[0])
    assert prompt.endswith("Let me think<|im_end|>\n<|im_start|>assistant\n"), prompt[-80:]


def test_another_keys_response_cannot_be_retrieved_or_deleted(gw, redis_client, prefix):
    from flywheel.gateway.api.responses_store import ResponseStore, StoredResponse

    make, _, _ = gw
    client, _ = make([])
    store = ResponseStore(redis_client, prefix, 60)
    theirs = StoredResponse("other-key", "", [], {"id": "resp_theirs", "object": "response"})
    asyncio.run(store.put("resp_theirs", theirs))
    for method in ("GET", "DELETE"):
        reply = client.request(method, "/v1/responses/resp_theirs")
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["type"] == "not_found_error"
    assert asyncio.run(store.get("resp_theirs", "other-key", None)).response == theirs.response


def test_session_header_setting_and_prompt_cache_key_name_live_sessions(gw):
    make, _, _ = gw
    client, _ = make(["a", "b", "c"], session_headers=["X-Conversation-Id"])
    client.post(
        "/v1/responses",
        json={"model": "m", "input": "x"},
        headers={"x-conversation-id": "conv one"},
    )  # not a valid id: hashed
    client.post("/v1/responses", json={"model": "m", "input": "y", "prompt_cache_key": "pck-1"})
    client.post(
        "/v1/responses",
        json={"model": "m", "input": "z", "prompt_cache_key": "pck-2"},
        headers={"X-Conversation-Id": "conv-2"},  # the header wins over the body's key
    )
    hashed = "k-" + hashlib.sha256(b"conv one").hexdigest()[:40]
    for sid in (hashed, "pck-1", "conv-2"):
        info = client.get(f"/v1/sessions/{sid}").json()
        assert info["mode"] == "live" and info["turns"] == 1, (sid, info)
    assert client.get("/v1/sessions/pck-2").status_code == 404


def test_a_misspelled_or_credential_session_header_setting_is_refused():
    with pytest.raises(ValueError, match="not an HTTP header name"):
        GatewaySettings(session_headers=["x conversation"])
    with pytest.raises(ValueError, match="credential"):
        GatewaySettings(session_headers=["Authorization"])
    with pytest.raises(ValueError, match="session_header"):
        GatewaySettings(session_header=["x-conversation-id"])


def test_logprobs_are_included_on_request(gw):
    make, _, _ = gw
    client, _ = make(["Eight."])
    r = client.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": "x",
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 1,
        },
    ).json()
    part = r["output"][0]["content"][0]
    assert [p["logprob"] for p in part["logprobs"]] == [-0.5, -0.5, -0.5]
    assert "".join(p["token"] for p in part["logprobs"][:2]) == "Eight."


NONSENSE = {"type": "nonsense"}  # not a JSON Schema: xgrammar could not compile it


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "include": ["bogus"]}, "include"),
        ({"model": "m", "input": "x", "max_ouput_tokens": 5}, "max_ouput_tokens"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        (
            {
                "model": "m",
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "s", "schema": NONSENSE}},
            },
            "text.format.schema",
        ),
        (
            {
                "model": "m",
                "input": "x",
                "tools": [{"type": "function", "name": "f", "parameters": NONSENSE}],
                "tool_choice": "required",
            },
            "tools[0].parameters",
        ),
    ],
)
def test_bad_requests_are_400_in_openai_error_format(gw, body, param):
    make, _, _ = gw
    client, engine = make(["never"])
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert engine.prompts == []  # refused before any generation


# A template that renders an assistant turn's `reasoning_content` as a <think> block (as Qwen3's
# does for the turns after the last user message), so dropping it changes the rendered history.
THINKING = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] -%}"
    '{{ \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ call.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def thinking(smollm2_dir, tmp_path_factory):
    base = ChatRenderer(smollm2_dir)
    base.tokenizer.chat_template = THINKING
    folder = tmp_path_factory.mktemp("thinking_tokenizer")
    base.tokenizer.save_pretrained(folder)
    return ChatRenderer(folder)


@pytest.mark.parametrize("send_reasoning", [True, False])
def test_reasoning_items_sent_back_keep_a_thinking_template_on_the_recorded_ids(
    redis_client, prefix, thinking, send_reasoning
):
    client, deps, _ = gateway_app(redis_client, prefix, thinking, None)
    deps.engines = ScriptEngine(thinking, [f"<think>\nI add.\n</think>\n\n{CALL}", "It is 8."])
    api = sdk(client, **{"X-Session-Id": "think-1"})
    items: list[dict] = [{"role": "user", "content": "What is 7 + 1?"}]
    r1 = api.responses.create(
        model="m", input=items, tools=[TOOL], include=["reasoning.encrypted_content"]
    )
    reasoning, call = r1.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I add."
    assert reasoning.encrypted_content == "I add."
    assert r1.usage.output_tokens_details.reasoning_tokens == len(thinking.encode("I add."))
    sent = r1.output if send_reasoning else [call]
    items += [item.model_dump(exclude_none=True) for item in sent]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "8"})
    assert api.responses.create(model="m", input=items, tools=[TOOL]).output_text == "It is 8."
    record = SessionStore(redis_client, prefix, 60).get("think-1")
    # Sent back, the reasoning renders as it was recorded: the turn extends the segment.
    # Dropped, the template renders the turn without its <think> block: a fork, counted.
    assert record.forks == (0 if send_reasoning else 1), record.fork_reasons


def test_a_configured_session_header_names_chat_sessions_too(gw):
    make, _, _ = gw
    client, _ = make(["a", "b"], session_headers=["x-conversation-id"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    reply = client.post("/v1/chat/completions", json=chat, headers={"x-conversation-id": "c-1"})
    assert reply.status_code == 200, reply.text
    assert client.get("/v1/sessions/c-1").json()["turns"] == 1
    # X-Session-Id, when sent, wins over the configured header.
    both = {"x-conversation-id": "c-1", "X-Session-Id": "explicit-1"}
    assert client.post("/v1/chat/completions", json=chat, headers=both).status_code == 200
    assert client.get("/v1/sessions/explicit-1").json()["turns"] == 1
    assert client.get("/v1/sessions/c-1").json()["turns"] == 1


def test_a_client_that_rewrites_its_output_items_forks_and_it_is_counted(gw, redis_client, prefix):
    make, _, _ = gw
    client, _ = make([f"Let me add. {CALL}", "It is 8."])
    api = sdk(client, **{"X-Session-Id": "edit-1"})
    items: list[dict] = [{"role": "user", "content": "What is 7 + 1?"}]
    r1 = api.responses.create(model="m", input=items, tools=[TOOL])
    message, call = (item.model_dump(exclude_none=True) for item in r1.output)
    message["content"][0]["text"] = "I will add."  # not what the model said
    items += [
        message,
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "8"},
    ]
    api.responses.create(model="m", input=items, tools=[TOOL])
    record = SessionStore(redis_client, prefix, 60).get("edit-1")
    assert record.forks == 1 and record.fork_reasons == {"assistant_edited": 1}


WIDE = 2**70  # 1180591620717411303424: wider than 64 bits, valid JSON


@pytest.mark.parametrize("stream", [True, False])
def test_integers_wider_than_64_bits_are_echoed_back_exactly(gw, stream):
    """A tool schema's `maximum` of 2**70 comes back unchanged in the response object (streamed
    events too), and the response is stored for `previous_response_id`."""
    make, _, _ = gw
    client, _ = make(["Noted.", "Again."])
    tool = {**TOOL, "parameters": {"type": "object", "properties": {"a": {"maximum": WIDE}}}}
    body = {"model": "m", "input": "Hi", "tools": [tool], "stream": stream}
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == 200
    if stream:
        datas = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        events = [json.loads(d) for d in datas]
        assert events[-1]["type"] == "response.completed", events[-1]
        final = events[-1]["response"]
    else:
        final = resp.json()
    assert final["tools"][0]["parameters"]["properties"]["a"]["maximum"] == WIDE
    again = client.post(
        "/v1/responses", json={"model": "m", "input": "More", "previous_response_id": final["id"]}
    )
    assert again.status_code == 200, again.text
