"""Field failures about weight versions and sampling settings (docs/failure-cases.md, CPU
tier): BUG-19 per-token versions and BUG-07 one sampling setting per Sample."""

import pytest

from flywheel.core.errors import UpstreamError
from flywheel.gateway.engines.generation import parse_generation
from flywheel.gateway.recording.history import record_reply, sampled_reply
from flywheel.gateway.recording.records import SessionRecord
from flywheel.gateway.render.tokenization import ChatRenderer

from .field_failure_support import EOS, SAMPLING, run_episode, scripted_app
from .field_failure_support import make_gen as _gen

_episode = run_episode


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    return ChatRenderer(smollm2_dir)


@pytest.fixture
def app(redis_client, prefix, renderer):
    return scripted_app(redis_client, prefix, renderer)


# BUG-19: a request that straddles a weight update records each token's own version, from the
# engine's `meta_info.weight_versions` spans, not the version at completion.
def _straddling_body(ids, spans):
    return {
        "output_ids": ids,
        "text": "x",
        "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "weight_version": "4",
            "weight_versions": spans,
            "finish_reason": {"type": "stop", "matched": EOS},
        },
    }


def test_bug19_per_token_weight_versions_come_from_the_engine_spans(app, renderer):
    client, use, samples = app
    ids = [10, 11, 12, 13, EOS]
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    gen = parse_generation(_straddling_body(ids, spans), {EOS})
    assert gen.token_versions() == [3, 3, 4, 4, 4]
    use(gen)
    resp, sample = _episode(
        client, {"model": "m", "messages": [{"role": "user", "content": "go"}]}, samples
    )
    assert resp.json()["metadata"]["weight_version"] == "4"
    n = sample.prompt_length
    assert list(sample.weight_versions[n:]) == [3, 3, 4, 4, 4]
    assert set(sample.weight_versions[:n]) == {-1}  # prompt tokens were not sampled
    # Without spans every token is the completion version.
    plain = parse_generation(_straddling_body(ids, None), {EOS})
    assert plain.token_versions() == [4] * 5


def test_bug19_n_choices_keep_their_per_token_versions():
    from flywheel.gateway.recording.history import candidate_segment  # noqa: PLC0415

    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    gen = parse_generation(_straddling_body([10, 11, EOS], spans), {EOS})
    kept = sampled_reply(gen, {"role": "assistant", "content": "x"})
    assert kept.token_versions() == [3, 4, 4]
    # kept as the record stores a choice, and read back: the versions survive
    kept = SessionRecord.model_validate_json(
        SessionRecord(session_id="s", candidates=[kept]).model_dump_json()
    ).candidates[0]
    record = SessionRecord(session_id="s", mode="live")
    seg = candidate_segment(record.segment, kept)
    assert seg.versions[-3:] == [3, 4, 4]
    record_reply(record, kept, SAMPLING)  # the choice the client continued with
    assert record.segment.versions[-3:] == [3, 4, 4]


@pytest.mark.parametrize(
    "spans",
    [
        [{"version": "3", "start": 0, "end": 2}],  # covers 2 of 5 tokens
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}],  # a gap
        [{"version": "3", "begin": 0, "end": 5}],  # no start
    ],
)
def test_bug19_spans_that_do_not_cover_the_output_are_refused(spans):
    with pytest.raises(UpstreamError, match="weight_versions"):
        parse_generation(_straddling_body([10, 11, 12, 13, EOS], spans), {EOS})


# BUG-07: a Sample carries one sampling setting, the one the trainer recomputes logprobs with; an
# episode turn drawn at another temperature (or top_p/top_k/min_p) starts a new segment.
@pytest.mark.parametrize(
    ("first_t", "second", "forked"),
    [
        (0.5, {"temperature": 1.0}, True),
        (0.5, {"temperature": 0.5, "top_p": 0.9}, True),
        (0.5, {"temperature": 0.5, "max_tokens": 3}, False),  # the cap leaves the distribution
        (0.0, {"temperature": 0.0, "top_p": 0.5}, False),  # greedy takes the argmax either way
        (0.0, {"temperature": 0.5}, True),
    ],
)
def test_bug07_episode_turn_with_other_sampling_is_its_own_sample(
    app, renderer, first_t, second, forked
):
    client, use, samples = app
    reply = renderer.encode("8") + [EOS]
    use(_gen(reply, "8"))
    sid = client.post("/v1/sessions", json={}).json()["session_id"]
    first = [{"role": "user", "content": "7 + 1?"}]
    assert (
        client.post(
            f"/s/{sid}/v1/chat/completions",
            json={"model": "m", "messages": first, "temperature": first_t},
        ).status_code
        == 200
    )
    then = [*first, {"role": "assistant", "content": "8"}, {"role": "user", "content": "+1?"}]
    assert (
        client.post(
            f"/s/{sid}/v1/chat/completions", json={"model": "m", "messages": then, **second}
        ).status_code
        == 200
    )
    info = client.get(f"/v1/sessions/{sid}").json()
    client.post(f"/v1/sessions/{sid}/finish", json={})
    published = [s for s in samples() if s.session_id == sid]
    temps = [round(s.sampling.temperature, 6) for s in published]
    if forked:
        assert info["forks"] == 1 and info["fork_reasons"] == {"sampling_changed": 1}
        assert temps == [first_t, second["temperature"]]
        assert [sum(s.loss_mask) for s in published] == [len(reply), len(reply)]
    else:
        assert info["forks"] == 0 and temps == [first_t]
        assert sum(published[0].loss_mask) == 2 * len(reply)
