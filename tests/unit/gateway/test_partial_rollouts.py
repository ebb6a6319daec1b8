"""Partial rollouts (engines/partial.py): an aborted generation keeps its tokens, continues with
the rest of its budget, and the joined Generation carries each part's versions and logprobs.
The engine here is a scripted call that answers from a fixed plan of parts."""

import asyncio

import pytest

from flywheel.core.errors import UpstreamError
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.engines.partial import (
    PARTIAL_ROLLOUTS,
    continuable,
    generate_partial,
    join,
    rest_of,
)


def _gen(ids, version, finish, logprobs=None, text=""):
    return Generation(
        output_ids=ids,
        output_logprobs=logprobs or [-0.5] * len(ids),
        text=text,
        finish_type=finish,
        matched_eos=finish == "stop",
        weight_version=version,
        prompt_tokens=4,
        matched=2 if finish == "stop" else None,
    )


def test_join_concatenates_parts_with_their_versions_and_the_last_finish():
    a = _gen([5, 6], 3, "abort", [-0.1, -0.2], "ab")
    b = _gen([7, 2], 4, "stop", [-0.3, -0.4], "c")
    gen = join([a, b], max_new_tokens=8)
    assert gen.output_ids == [5, 6, 7, 2]
    assert gen.output_logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert gen.token_versions() == [3, 3, 4, 4]
    assert (gen.finish_type, gen.weight_version, gen.parts, gen.text) == ("stop", 4, 2, "abc")
    # A part whose own tokens changed version mid-call keeps its spans.
    mixed = Generation([8, 9], [-1.0, -1.0], "", "length", False, 5, 4, output_versions=[4, 5])
    assert join([a, mixed], 4).token_versions() == [3, 3, 4, 5]
    # The budget used up by an aborted last part: length.
    assert join([a, _gen([7, 8], 4, "abort")], max_new_tokens=4).finish_type == "length"
    with pytest.raises(ValueError):
        join([], 4)


def test_rest_of_lowers_the_budget_and_offsets_the_seed():
    rest = rest_of({"max_new_tokens": 64, "min_new_tokens": 8, "sampling_seed": 7}, 40)
    # 64 - 40 = 24 left; min 8 - 40 -> 0; seed 7 + 40 = 47
    assert rest == {"max_new_tokens": 24, "min_new_tokens": 0, "sampling_seed": 47}
    assert rest_of({"max_new_tokens": 5, "temperature": 1.0}, 2) == {
        "max_new_tokens": 3,
        "temperature": 1.0,
    }
    assert rest_of({}, 28) == {"max_new_tokens": 100}  # SGLang's default 128 - 28


def test_continuable_refuses_grammars_and_output_penalties():
    assert continuable({"max_new_tokens": 4, "temperature": 1.0, "repetition_penalty": 1.0})
    assert not continuable({"max_new_tokens": 4, "json_schema": "{}"})
    assert not continuable({"max_new_tokens": 4, "regex": "a+"})
    assert not continuable({"max_new_tokens": 4, "frequency_penalty": 0.5})
    assert not continuable({"max_new_tokens": 4, "repetition_penalty": 1.1})


class Script:
    """A scripted engine: answers call k with plan[k]; records what it was sent."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.sent: list[tuple[list[int], dict]] = []

    async def __call__(self, ids, params):
        self.sent.append((list(ids), dict(params)))
        return "http://engine", self.plan.pop(0)


def test_an_aborted_generation_is_continued_until_it_finishes():
    script = Script(
        [
            _gen([5, 6], 0, "abort"),
            _gen([], 1, "abort"),  # aborted again while waiting: no tokens
            _gen([7, 2], 1, "stop"),
        ]
    )
    before = PARTIAL_ROLLOUTS.labels("continued")._value.get()
    gen, parts = asyncio.run(generate_partial(script, [1, 2, 3], {"max_new_tokens": 10}))
    assert parts == 3 and gen.output_ids == [5, 6, 7, 2]
    assert gen.token_versions() == [0, 0, 1, 1]
    # prompt + kept tokens; 10 - 2 = 8 left on both continuations
    assert script.sent == [
        ([1, 2, 3], {"max_new_tokens": 10}),
        ([1, 2, 3, 5, 6], {"max_new_tokens": 8}),
        ([1, 2, 3, 5, 6], {"max_new_tokens": 8}),
    ]
    assert PARTIAL_ROLLOUTS.labels("continued")._value.get() == before + 2


def test_a_grammar_generation_restarts_or_fails_when_streamed():
    sampling = {"max_new_tokens": 10, "json_schema": "{}"}
    script = Script([_gen([5, 6], 0, "abort"), _gen([9, 2], 1, "stop")])
    gen, parts = asyncio.run(generate_partial(script, [1], sampling))
    assert (gen.output_ids, parts) == ([9, 2], 1)  # the partial [5, 6] is discarded
    assert script.sent[1] == ([1], sampling)
    script = Script([_gen([5, 6], 0, "abort")])
    with pytest.raises(UpstreamError, match="cannot continue"):
        asyncio.run(generate_partial(script, [1], sampling, restart=False))
    # aborted before its first token, a streamed one is sampled again: nothing was shown
    script = Script([_gen([], 0, "abort"), _gen([9, 2], 1, "stop")])
    gen, _ = asyncio.run(generate_partial(script, [1], sampling, restart=False))
    assert gen.output_ids == [9, 2]


def test_an_abort_with_the_budget_spent_finishes_as_length():
    script = Script([_gen([5, 6], 0, "abort"), _gen([7], 1, "abort")])
    gen, parts = asyncio.run(generate_partial(script, [1], {"max_new_tokens": 3}))
    assert (gen.output_ids, gen.finish_type, parts) == ([5, 6, 7], "length", 2)
