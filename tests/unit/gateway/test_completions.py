"""`POST /v1/completions`: raw prompts (text or ids), batches, logprobs, streaming, and
token-faithful recording in an episode session (fake engine, real Redis and tokenizer)."""

import json

import pytest

from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.render.tokenization import ChatRenderer

from .harness import gateway_app


class Engine:
    """Completes every prompt with " 8" (ids of " 8", no EOS: finish length)."""

    def __init__(self, renderer):
        self.ids = renderer.encode(" 8")
        self.calls = []

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        self.calls.append((list(input_ids), dict(sampling_params), top_logprobs_num))
        tops = [[(-0.1, t), (-3.0, 42)] for t in self.ids] if top_logprobs_num else []
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.1] * len(self.ids),
            text=" 8",
            finish_type="length",
            matched_eos=False,
            weight_version=1,
            prompt_tokens=len(input_ids),
            output_top_logprobs=tops,
        )


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def env(redis_client, prefix, renderer):
    engine = Engine(renderer)
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    return client, engine, samples


def test_text_and_id_prompts_batches_and_logprobs(env, renderer):
    client, engine, _ = env
    body = client.post(
        "/v1/completions", json={"model": "m", "prompt": "7 + 1 =", "max_tokens": 3, "logprobs": 1}
    ).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " 8"
    assert engine.calls[0][0] == renderer.encode("7 + 1 =")  # no template, no special tokens
    assert engine.calls[0][1]["max_new_tokens"] == 3 and engine.calls[0][2] == 1
    lp = body["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == " 8" and lp["token_logprobs"] == [-0.1] * len(engine.ids)
    assert lp["top_logprobs"][0] == {renderer.tokenizer.decode([engine.ids[0]]): -0.1}
    assert body["usage"] == {
        "prompt_tokens": len(engine.calls[0][0]),
        "completion_tokens": len(engine.ids),
        "total_tokens": len(engine.calls[0][0]) + len(engine.ids),
    }
    ids = [1, 2, 3]
    batch = client.post(
        "/v1/completions", json={"model": "m", "prompt": [ids, [4, 5]], "n": 2}
    ).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert engine.calls[1][0] == ids and engine.calls[3][0] == [4, 5]
    assert engine.calls[1][1]["max_new_tokens"] == 16  # OpenAI's default for completions


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": [1, 10**9]}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "foo": 1}, "foo"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [[]]}, "prompt"),
        ({"model": "m", "prompt": [5] * 2100}, "prompt"),
    ],
)  # the last: longer than the 2048-token window
def test_invalid_completion_requests_are_400_naming_the_field(env, body, param):
    client, engine, _ = env
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert engine.calls == []


def test_streamed_completion_ends_with_done(env):
    client, _, _ = env
    resp = client.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": "7 + 1 =",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    first, usage = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["text"] == " 8" and usage["usage"]["completion_tokens"] > 0


def test_session_completions_extend_the_recorded_ids(env, renderer):
    client, engine, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    first = client.post(f"/s/{sid}/v1/completions", json={"model": "m", "prompt": "7 + 1 ="}).json()
    text = "7 + 1 =" + first["choices"][0]["text"] + "\n2 + 2 ="
    client.post(f"/s/{sid}/v1/completions", json={"model": "m", "prompt": text})
    p1 = engine.calls[0][0]
    assert engine.calls[1][0][: len(p1) + len(engine.ids)] == p1 + engine.ids
    assert engine.calls[1][0][len(p1) + len(engine.ids) :] == renderer.encode("\n2 + 2 =")
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    (sample,) = samples()
    n = len(engine.ids)
    assert list(sample.token_ids) == engine.calls[1][0] + engine.ids
    assert sum(sample.loss_mask) == 2 * n and sample.prompt_length == len(p1)
    assert json.loads(sample.messages[-1].content_json) == " 8"
    assert client.get(f"/v1/sessions/{sid}").json()["forks"] == 0


def test_session_completion_at_another_temperature_starts_a_new_sample(env, renderer):
    client, engine, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    first = client.post(
        f"/s/{sid}/v1/completions", json={"model": "m", "prompt": "7 + 1 =", "temperature": 0.5}
    ).json()
    text = "7 + 1 =" + first["choices"][0]["text"] + "\n2 + 2 ="
    client.post(f"/s/{sid}/v1/completions", json={"model": "m", "prompt": text, "temperature": 1.0})
    info = client.get(f"/v1/sessions/{sid}").json()
    assert info["fork_reasons"] == {"sampling_changed": 1}
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    one, two = samples()
    # Each Sample holds one turn's tokens and the temperature they were drawn at; the second
    # starts from a fresh tokenization of its whole prompt.
    assert [round(s.sampling.temperature, 6) for s in (one, two)] == [0.5, 1.0]
    assert sum(one.loss_mask) == sum(two.loss_mask) == len(engine.ids)
    assert list(two.token_ids[: two.prompt_length]) == renderer.encode(text)


def test_live_session_completions_are_one_sample_per_turn(env, renderer):
    client, engine, samples = env
    headers = {"X-Session-Id": "raw-live"}
    first = client.post(
        "/v1/completions", headers=headers, json={"model": "m", "prompt": "7 + 1 ="}
    )
    assert first.status_code == 200, first.text
    assert client.get("/v1/sessions/raw-live").json()["mode"] == "live"
    assert samples() == []  # turn 0 waits for its next state
    text = "7 + 1 =" + first.json()["choices"][0]["text"] + "\n2 + 2 ="
    second = client.post("/v1/completions", headers=headers, json={"model": "m", "prompt": text})
    assert second.status_code == 200, second.text
    (turn0,) = samples()
    p1, n = engine.calls[0][0], len(engine.ids)
    assert list(turn0.token_ids) == p1 + engine.ids
    assert list(turn0.loss_mask) == [0] * len(p1) + [1] * n
    assert list(turn0.rollout_logprobs[len(p1) :]) == pytest.approx([-0.1] * n)
    assert turn0.mode == "live" and turn0.turn_index == 0
    assert turn0.next_state.role == "user"
    assert json.loads(turn0.next_state.content_json) == "\n2 + 2 ="
    # Turn 1's prompt holds turn 0's sampled ids exactly, then only the new text.
    p2 = engine.calls[1][0]
    assert p2 == p1 + engine.ids + renderer.encode("\n2 + 2 =")
    # A prompt on turn 0's history again is a branch: it continues turn 0's ids as well.
    again = "7 + 1 =" + first.json()["choices"][0]["text"] + "\n3 + 5 ="
    client.post("/s/raw-live/v1/completions", json={"model": "m", "prompt": again})
    assert engine.calls[2][0] == p1 + engine.ids + renderer.encode("\n3 + 5 =")
    assert len(samples()) == 1  # turn 1 did not get this request as its next state
    done = client.post("/v1/sessions/raw-live/finish", json={}).json()
    assert done["samples_published"] == 2
    published = samples()
    assert sorted(s.turn_index for s in published) == [0, 1, 2]
    for s in published[1:]:
        assert not s.HasField("next_state") and sum(s.loss_mask) == n
    info = client.get("/v1/sessions/raw-live").json()
    assert info["forks"] == 0 and info["status"] == "finished"


class Scripted:
    """Answers each call with the next (ids, logprobs) of `outputs`."""

    def __init__(self, outputs):
        self.outputs, self.calls = list(outputs), []

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        self.calls.append(list(input_ids))
        ids, lps = self.outputs.pop(0)
        return Generation(
            output_ids=ids,
            output_logprobs=lps,
            text="",
            finish_type="length",
            matched_eos=False,
            weight_version=1,
            prompt_tokens=len(input_ids),
        )


def test_bug02_art883_a_sampled_token_under_a_changed_prefix_is_never_trained_again(
    redis_client, prefix, renderer
):
    # The case's exchanges, ids shifted by 100 (SmolLM2's id 2 is its EOS):
    # exchange 1: prompt [101] -> [102, 103]; exchange 2: prompt [101, 103, 104] -> [105]
    engine = Scripted([([102, 103], [-0.1, -0.3]), ([105], [-0.2])])
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    for prompt in ([101], [101, 103, 104]):
        assert (
            client.post(
                f"/s/{sid}/v1/completions", json={"model": "m", "prompt": prompt}
            ).status_code
            == 200
        )
    assert engine.calls == [[101], [101, 103, 104]]  # the client's prompt, not a spliced one
    assert client.get(f"/v1/sessions/{sid}").json()["fork_reasons"] == {"history_edited": 1}
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    first, second = samples()
    assert (list(first.token_ids), list(first.loss_mask)) == ([101, 102, 103], [0, 1, 1])
    assert list(first.rollout_logprobs[1:]) == pytest.approx([-0.1, -0.3])
    # Token 103 is context of exchange 2 (mask 0): its old logprob came under another prefix.
    assert (list(second.token_ids), list(second.loss_mask)) == ([101, 103, 104, 105], [0, 0, 0, 1])
    assert list(second.rollout_logprobs) == pytest.approx([0.0, 0.0, 0.0, -0.2])


def test_session_sample_records_the_stop_strings_and_seed_the_engine_got(env):
    client, engine, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    client.post(
        f"/s/{sid}/v1/completions",
        json={
            "model": "m",
            "prompt": "7 + 1 =",
            "temperature": 0.5,
            "stop": ["\n\n", "###"],
            "seed": -1,
        },
    )
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    (sample,) = samples()
    # OpenAI's seed is a signed int64; SGLang's sampling_seed is non-negative:
    # -1 % 2**63 = 2**63 - 1 = 9223372036854775807, the value the engine got and the Sample keeps.
    assert engine.calls[0][1]["sampling_seed"] == 2**63 - 1
    assert sample.sampling.has_seed and sample.sampling.seed == 2**63 - 1
    assert list(sample.sampling.stop) == ["\n\n", "###"]


def test_session_sample_without_seed_or_stop_says_so(env):
    client, engine, samples = env
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    client.post(f"/s/{sid}/v1/completions", json={"model": "m", "prompt": "7 + 1 ="})
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    (sample,) = samples()
    assert not sample.sampling.has_seed and sample.sampling.seed == 0
    assert list(sample.sampling.stop) == []


class StopInsideToken(Engine):
    """Samples " there" and stops on the stop string "he" inside it: the reply is " t"."""

    def __init__(self, renderer):
        super().__init__(renderer)
        self.ids = renderer.encode(" there")

    async def generate(self, input_ids, sampling_params, affinity="", top_logprobs_num=0):
        self.calls.append((list(input_ids), dict(sampling_params), top_logprobs_num))
        return Generation(
            output_ids=self.ids,
            output_logprobs=[-0.1] * len(self.ids),
            text=" t",
            finish_type="stop",
            matched="he",
            matched_eos=False,
            weight_version=1,
            prompt_tokens=len(input_ids),
        )


@pytest.mark.parametrize(
    ("follow_up", "stitched"),
    [
        (" t Then", False),  # the text the client got: the context holds " there", not " t"
        (" there Then", True),  # the text the ids hold: extends the recorded ids
    ],
)
def test_a_stop_string_inside_a_token_is_compared_with_the_text_the_ids_hold(
    redis_client, prefix, renderer, follow_up, stitched
):
    engine = StopInsideToken(renderer)
    client, _, samples = gateway_app(redis_client, prefix, renderer, engine)
    sid = client.post("/v1/sessions", json={"group_id": "g"}).json()["session_id"]
    first = "Once upon a time,"
    reply = client.post(
        f"/s/{sid}/v1/completions", json={"model": "m", "prompt": first, "stop": ["he"]}
    )
    assert reply.json()["choices"][0]["text"] == " t"
    client.post(f"/s/{sid}/v1/completions", json={"model": "m", "prompt": first + follow_up})
    sent = engine.calls[1][0]
    info = client.get(f"/v1/sessions/{sid}").json()
    if stitched:
        # recorded prompt + the sampled " there" + only the new text
        assert sent == engine.calls[0][0] + engine.ids + renderer.encode(" Then")
        assert info["forks"] == 0
    else:
        # a new segment: the client's prompt tokenized as it stands (never " there Then")
        assert sent == renderer.encode(first + follow_up)
        assert info["fork_reasons"] == {"history_edited": 1}
    client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0})
    assert len(samples()) == (1 if stitched else 2)


def test_stream_options_without_stream_is_refused_as_in_chat(env):
    client, engine, _ = env
    reply = client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "7 + 1 =", "stream_options": {"include_usage": True}},
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options"
    assert engine.calls == []
