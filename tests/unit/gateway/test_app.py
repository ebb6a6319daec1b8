"""Gateway routes with a fake engine (canned tokens), real Redis and the real tokenizer."""

import pytest
from fastapi.testclient import TestClient

from flywheel.core.codec import decode_sample
from flywheel.core.settings import GatewaySettings
from flywheel.core.streams import FIELD, StreamProducer
from flywheel.gateway.app import create_app
from flywheel.gateway.deps import GatewayDeps
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer
from flywheel.gateway.session.store import SessionStore


class FakeEngine:
    """Returns "8" + EOS with fixed logprobs; records the prompts it got."""

    def __init__(self, renderer):
        self.ids = renderer.encode("8") + [2]
        self.prompts = []

    async def generate(self, input_ids, sampling_params, affinity=""):
        self.prompts.append((list(input_ids), dict(sampling_params)))
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.25, -0.5],
            text="8",
            finish_type="stop",
            matched_eos=True,
            weight_version=4,
            prompt_tokens=len(input_ids),
        )


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def env(redis_client, prefix, renderer):
    engine = FakeEngine(renderer)
    producer = StreamProducer(
        redis_client, f"{prefix}:rollouts", high_water=2, watch_group="reward"
    )
    deps = GatewayDeps(
        settings=GatewaySettings(),
        renderer=renderer,
        engines=engine,
        sessions=SessionStore(redis_client, prefix, 3600),
        publisher=producer,
    )
    return TestClient(create_app(deps)), engine, redis_client, prefix


def _chat(client, base, **body):
    body.setdefault("messages", [{"role": "user", "content": "What is 7 + 1?"}])
    return client.post(f"{base}/chat/completions", json={"model": "m", **body})


def test_session_episode_publishes_one_faithful_sample(env):
    client, engine, redis_client, prefix = env
    created = client.post("/v1/sessions", json={"group_id": "g", "task": {"answer": 8}}).json()
    base = created["base_url"].removeprefix("http://testserver")
    reply = _chat(client, base, max_completion_tokens=7, temperature=0.5).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "8"}
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 2
    prompt, sampling = engine.prompts[0]
    assert sampling["max_new_tokens"] == 7 and sampling["temperature"] == 0.5  # BUG-30
    done = client.post(f"/v1/sessions/{created['session_id']}/finish", json={"reward": 1.0})
    assert done.json()["samples_published"] == 1
    retry = client.post(f"/v1/sessions/{created['session_id']}/finish", json={"reward": 1.0})
    assert retry.json() == {**done.json(), "replayed": True}  # answered again, published once
    ((_, fields),) = redis_client.xrange(f"{prefix}:rollouts")
    sample = decode_sample(fields[FIELD])
    assert list(sample.token_ids) == prompt + engine.ids
    assert list(sample.loss_mask) == [0] * len(prompt) + [1, 1]
    assert list(sample.rollout_logprobs[len(prompt) :]) == [-0.25, -0.5]
    assert list(sample.weight_versions[len(prompt) :]) == [4, 4]
    assert sample.group_id == "g" and sample.rewards["outcome"] == 1.0


def test_eval_session_is_served_but_never_published(env):
    client, _, redis_client, prefix = env
    created = client.post("/v1/sessions", json={"eval": True}).json()
    base = created["base_url"].removeprefix("http://testserver")
    assert _chat(client, base).status_code == 200
    done = client.post(f"/v1/sessions/{created['session_id']}/finish", json={}).json()
    assert done["samples_published"] == 0
    assert redis_client.xlen(f"{prefix}:rollouts") == 0


def test_errors_are_openai_json(env):
    client, _, _, _ = env
    missing = _chat(client, "/s/nope/v1")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    bad = _chat(client, "/v1", temperature=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    empty = _chat(client, "/v1", messages=[])
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    created = client.post("/v1/sessions", json={}).json()
    sid = created["session_id"]
    first = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    # the same finish again (a retry after a lost response) gets the first answer back
    again = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert again.status_code == 200 and again.json()["replayed"] is True
    assert again.json()["samples_published"] == first.json()["samples_published"]
    other = client.post(f"/v1/sessions/{sid}/finish", json={"reward": 0.0})
    assert other.status_code == 409 and "already finished" in other.json()["error"]["message"]
    late = _chat(client, f"/s/{sid}/v1")
    assert late.status_code == 409


def test_backpressure_refuses_new_training_sessions_with_retry_after(env):
    client, _, redis_client, prefix = env
    redis_client.xgroup_create(f"{prefix}:rollouts", "reward", id="0", mkstream=True)
    for _ in range(2):
        sid = client.post("/v1/sessions", json={}).json()["session_id"]
        _chat(client, f"/s/{sid}/v1")
        client.post(f"/v1/sessions/{sid}/finish", json={})
    refused = client.post("/v1/sessions", json={})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
    assert client.post("/v1/sessions", json={"eval": True}).status_code == 200
    assert redis_client.xlen(f"{prefix}:rollouts") == 2  # nothing trimmed


def test_unrecognized_fields_are_a_400_naming_them_and_models_listed(env):
    client, _, _, _ = env
    unknown = _chat(client, "/v1", frobnicate=True, user="u")  # BUG-30 (d): never ignored
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate"
    assert _chat(client, "/v1", user="u", store=False, parallel_tool_calls=True).status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"


class ToolEngine(FakeEngine):
    """Samples a Hermes tool call, then EOS."""

    def __init__(self, renderer):
        super().__init__(renderer)
        self.text = '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 1}}</tool_call>'
        self.ids = renderer.encode(self.text) + [2]

    async def generate(self, input_ids, sampling_params, affinity=""):
        self.prompts.append((list(input_ids), dict(sampling_params)))
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.1] * len(self.ids),
            text=self.text,
            finish_type="stop",
            matched_eos=True,
            weight_version=0,
            prompt_tokens=len(input_ids),
        )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def test_openai_sdk_streaming_and_tool_calls_through_a_session(env, renderer):
    import openai

    client, _, redis_client, prefix = env
    client.app.state.deps.engines = engine = ToolEngine(renderer)
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    sdk = openai.OpenAI(base_url=f"http://testserver/s/{sid}/v1", api_key="k", http_client=client)
    messages = [{"role": "user", "content": "What is 7 + 1?"}]
    stream = sdk.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "add" and calls[0].index == 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(engine.ids)
    # The agent sends the tool call back with the tool's result: history is extended, not forked.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [calls[0].model_dump(exclude={"index"})],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "8"},
    ]
    second = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.tool_calls[0].function.arguments == '{"a": 7, "b": 1}'
    client.post(f"/v1/sessions/{sid}/finish", json={})
    ((_, fields),) = redis_client.xrange(f"{prefix}:rollouts")
    sample = decode_sample(fields[FIELD])
    first_prompt, second_prompt = engine.prompts[0][0], engine.prompts[1][0]
    assert second_prompt[: len(first_prompt) + len(engine.ids)] == first_prompt + engine.ids
    assert sum(sample.loss_mask) == 2 * len(engine.ids)  # both turns in one Sample, no fork
    assert sample.segment_index == 0


def test_response_format_json_reaches_the_engine_as_a_json_schema_param(env):
    client, engine, _, _ = env
    assert _chat(client, "/v1", response_format={"type": "json_object"}).status_code == 200
    assert engine.prompts[-1][1]["json_schema"] == '{"type": "object"}'
    bad = _chat(client, "/v1", response_format={"type": "xml"})
    assert bad.status_code == 400 and "response_format" in bad.json()["error"]["message"]


def test_an_invalid_json_schema_is_a_400_naming_it_before_the_engine(env):
    client, engine, _, _ = env
    sent = len(engine.prompts)
    nonsense = {"type": "nonsense"}
    bad = _chat(
        client,
        "/v1",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": nonsense}},
    )
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "response_format.json_schema.schema", error
    assert "not a valid JSON Schema" in error["message"] and "'nonsense'" in error["message"]
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "add", "parameters": nonsense}},
    ]
    bad = _chat(client, "/v1", tools=tools, tool_choice="required")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[1].function.parameters"
    assert len(engine.prompts) == sent  # refused before any generation


def test_failed_request_after_a_fork_publishes_nothing_twice(env):
    client, engine, redis_client, prefix = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    base = f"/s/{sid}/v1"
    assert _chat(client, base).status_code == 200
    edited = [{"role": "user", "content": "something else entirely"}]
    for _ in range(2):  # forks history, then fails the context check: nothing is recorded
        assert _chat(client, base, messages=edited, max_tokens=10**6).status_code == 400
    assert redis_client.xlen(f"{prefix}:rollouts") == 0
    assert _chat(client, base, messages=edited).status_code == 200  # the fork succeeds now
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    samples = [decode_sample(f[FIELD]) for _, f in redis_client.xrange(f"{prefix}:rollouts")]
    assert [s.segment_index for s in samples] == [0, 1]
    assert len({s.sample_id for s in samples}) == 2
    # The closed segment was held until the finish, which gave both the outcome.
    assert [dict(s.rewards) for s in samples] == [{"outcome": 1.0}, {"outcome": 1.0}]


def test_malformed_json_and_redis_outage_are_openai_errors(env):
    from flywheel.core.redis_client import LoopClients, connect

    client, _, _, _ = env
    bad = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] is None
    deps = client.app.state.deps
    deps.sessions.client = connect("redis://127.0.0.1:1/0")  # nothing listens there
    deps.sessions._loop_clients = LoopClients(deps.sessions.client)
    down = client.post("/v1/sessions", json={"eval": True})
    assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable_error"


def test_n_choices_without_a_session(env):
    client, engine, _, _ = env
    body = _chat(client, "/v1", n=3, seed=7).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 3 * len(engine.ids)
    seeds = [p[1]["sampling_seed"] for p in engine.prompts[-3:]]
    assert sorted(seeds) == [7, 8, 9]  # distinct seeds, so the choices can differ


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 0),
        ("top_k", -5),
        ("top_k", 2**31),  # the Sample records top_k as int32: at most 2**31 - 1
        ("stop", ["x"] * 33),
        ("temperature", "Infinity"),
    ],
)
def test_invalid_sampling_values_are_400_before_the_engine(env, field, value):
    client, engine, _, _ = env
    before = len(engine.prompts)
    if value == "Infinity":
        bad = client.post(
            "/v1/chat/completions",
            headers={"content-type": "application/json"},
            content=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
            b'"temperature": Infinity}',
        )
    else:
        bad = _chat(client, "/v1", **{field: value})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert len(engine.prompts) == before  # never reached the engine
