"""Streamed chat answers sent as the engine samples them (incremental.py): what is held back,
what the client gets, and what is recorded (fake streaming engine, real Redis and tokenizer)."""

import asyncio
import json

import openai
import pytest
import redis

from flywheel.core.errors import UpstreamError
from flywheel.gateway.api.incremental import TextFeed, TurnStream, streamable
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app

ASK = [{"role": "user", "content": "What is 7 + 1?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "stops", "tools", "sendable"),
    [
        ("Hi", [], False, 2),
        ("Hello ##", ["###"], False, 6),  # "##" may begin "###": "Hello " goes out
        ("Hello ### more", ["###"], False, 6),  # never from a stop string on
        ("  ", [], False, 0),  # blank so far
        ("<thi", [], False, 0),  # may open a reasoning block
        ("<think>abc", [], False, 0),
        ('{"name"', [], True, 0),  # may be a JSON tool call
        ("{x", [], False, 2),  # no tools: just text
        ("Sure. <tool_", [], True, 5),  # "Sure." (a parsed call strips the space)
        ("Sure. <tool_call>{", [], True, 5),
        ("<tool_", [], False, 6),  # no tools offered: not a marker
        (" \n Let me check.", [], True, 0),  # a parsed call would strip the leading space
        (" \n Let me check.", [], False, 16),
        ("caf\ufffd", [], False, 3),  # the last character's bytes are not all there
    ],
)
def test_what_can_be_sent_while_sampling(text, stops, tools, sendable):
    assert streamable(text, stops, tools) == sendable


class StreamingEngine:
    """Samples `text` token by token, passing each cumulative text to `on_text`; `fail_after`
    tokens then an UpstreamError (a stream that broke) when set."""

    def __init__(
        self,
        renderer,
        text,
        *,
        stop=None,
        fail_after=None,
        failure=UpstreamError("the engine's stream broke after it started"),
    ):
        self.renderer, self.fail_after, self.stop = renderer, fail_after, stop
        self.failure = failure
        self.ids = renderer.encode(text) + ([] if stop else [2])
        self.text = text
        self.streamed = 0

    def _gen(self, n_prompt):
        text = self.text.split(self.stop)[0] if self.stop else self.text
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.5] * len(self.ids),
            text=text,
            finish_type="stop",
            matched=self.stop or 2,
            matched_eos=self.stop is None,
            weight_version=3,
            prompt_tokens=n_prompt,
        )

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        return self._gen(len(input_ids))

    async def generate_stream(
        self, input_ids, sampling_params, affinity="", top_logprobs_num=0, *, on_text
    ):
        self.streamed += 1
        for k in range(1, len(self.ids) + 1):
            if self.fail_after is not None and k > self.fail_after:
                raise self.failure
            on_text(self.renderer.decode(self.ids[:k]))
            await asyncio.sleep(0.001)
        return self._gen(len(input_ids))


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


def _app(redis_client, prefix, renderer, engine):
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    return client, samples, sid


def _events(client, sid, **body):
    with client.stream(
        "POST",
        f"/s/{sid}/v1/chat/completions",
        json={"model": "m", "messages": ASK, "stream": True, **body},
    ) as reply:
        assert reply.status_code == 200
        return [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


def _deltas(events):
    return [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]


def test_content_goes_out_token_by_token_and_equals_the_recorded_reply(
    redis_client, prefix, renderer
):
    text = "Seven plus one is eight, as counting on from seven shows."
    engine = StreamingEngine(renderer, text)
    client, samples, sid = _app(redis_client, prefix, renderer, engine)
    events = _events(client, sid, stream_options={"include_usage": True})
    deltas = _deltas(events)
    contents = [d["content"] for d in deltas if d.get("content")]
    assert engine.streamed == 1 and len(contents) > 5  # one delta per few tokens, not one
    assert "".join(contents) == text
    assert json.loads(events[-2])["usage"]["completion_tokens"] == len(engine.ids)
    assert events[-1] == "[DONE]"
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    (sample,) = samples()
    assert list(sample.token_ids[sample.prompt_length :]) == engine.ids
    assert json.loads(sample.messages[-1].content_json) == text


def test_a_stop_string_is_never_sent(redis_client, prefix, renderer):
    engine = StreamingEngine(renderer, "The answer is 8 ### and more", stop="###")
    client, _, sid = _app(redis_client, prefix, renderer, engine)
    deltas = _deltas(_events(client, sid, stop=["###"]))
    sent = [d["content"] for d in deltas if d.get("content")]
    assert "".join(sent) == "The answer is 8 " and all("#" not in s for s in sent)


def test_a_tool_call_is_held_back_and_sent_parsed(redis_client, prefix, renderer):
    engine = StreamingEngine(renderer, CALL)
    client, _, sid = _app(redis_client, prefix, renderer, engine)
    deltas = _deltas(_events(client, sid, tools=TOOLS))
    sent = "".join(d.get("content") or "" for d in deltas)
    assert sent == "Let me add." and "<" not in sent
    (call,) = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert call["index"] == 0 and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 7, "b": 1}


def test_the_openai_sdk_reads_the_stream(redis_client, prefix, renderer):
    engine = StreamingEngine(renderer, "Eight.")
    client, _, sid = _app(redis_client, prefix, renderer, engine)
    sdk = openai.OpenAI(base_url=f"http://testserver/s/{sid}/v1", api_key="k", http_client=client)
    chunks = list(sdk.chat.completions.create(model="m", messages=ASK, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Eight."
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("failure", "error_type"),
    [
        (UpstreamError("the engine's stream broke after it started"), "upstream_error"),
        (redis.ConnectionError("Connection refused"), "service_unavailable_error"),
        (RuntimeError("a bug"), "server_error"),
    ],
)
def test_a_stream_that_breaks_after_its_first_text_ends_well_formed_and_records_nothing(
    redis_client, prefix, renderer, failure, error_type
):
    engine = StreamingEngine(renderer, "Seven plus one is eight.", fail_after=3, failure=failure)
    client, samples, sid = _app(redis_client, prefix, renderer, engine)
    events = _events(client, sid)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == error_type
    assert _deltas(events[:-1])  # some text had gone out before
    info = client.get(f"/v1/sessions/{sid}").json()
    assert (info["turns"], info["forks"]) == (0, 0)
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert samples() == []


def test_a_refused_stream_keeps_its_http_status(redis_client, prefix, renderer):
    engine = StreamingEngine(renderer, "Eight.")
    client, _, sid = _app(redis_client, prefix, renderer, engine)
    client.post(f"/v1/sessions/{sid}/finish", json={})
    reply = client.post(
        f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": ASK, "stream": True}
    )
    assert reply.status_code == 409 and reply.json()["error"]["type"] == "conflict_error"
    assert engine.streamed == 0


def test_n_above_one_and_logprobs_are_answered_whole(redis_client, prefix, renderer):
    engine = StreamingEngine(renderer, "Eight.")
    client, _, sid = _app(redis_client, prefix, renderer, engine)
    for extra in ({"n": 2}, {"logprobs": True}):
        assert _events(client, sid, **extra)[-1] == "[DONE]"
    assert engine.streamed == 0


def test_a_stream_cancelled_before_its_first_event_still_stops_its_turn_and_its_wait():
    """A client gone before the answer's first event was produced (the events' own `finally`
    never runs): `TurnStream` stops the turn and cancels the wait for the first text, so no
    task is left pending (they would be destroyed pending when collected)."""

    async def scenario() -> tuple[bool, bool, list[bool]]:
        feed = TextFeed([], False)
        turn = asyncio.ensure_future(asyncio.Event().wait())  # a turn still sampling
        first = asyncio.ensure_future(feed.queue.get())
        began: list[bool] = []

        async def events():
            began.append(True)
            yield "data: x\n\n"

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.Event().wait()  # the client never takes the response's start

        await TurnStream(events(), turn, first, None)({"type": "http"}, receive, send)
        await asyncio.sleep(0)  # the cancelled wait unwinds
        return turn.cancelled(), first.cancelled(), began

    turn_stopped, wait_cancelled, began = asyncio.run(scenario())
    assert began == []  # the events never began: their `finally` had nothing to run
    assert turn_stopped and wait_cancelled
