"""Request expansion and JSON rules of the /generate protocol (torch-free)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from flywheel.core.errors import InvalidRequestError
from flywheel.engine.protocol import (
    GenerateRequest,
    SamplingParams,
    dumps,
    expand_generate,
    validation_message,
)


def expand(**body):
    return expand_generate(GenerateRequest.model_validate(body))


def test_single_prompt_keeps_its_rid_and_sglang_defaults():
    rows, is_batch = expand(input_ids=[1, 2], rid="a")
    assert not is_batch
    (row,) = rows
    assert row.rid == "a" and row.input_ids == [1, 2]
    assert row.params.max_new_tokens == 128 and row.params.temperature == 1.0
    assert row.params.top_k == 1 << 30
    assert row.logprob_start_len == -1 and row.return_logprob is False


def test_batch_broadcasts_scalars_and_suffixes_a_string_rid():
    rows, is_batch = expand(
        input_ids=[[1], [2, 3]],
        rid="r",
        sampling_params={"temperature": 0},
        logprob_start_len=[0, 1],
        return_logprob=True,
    )
    assert is_batch
    assert [r.rid for r in rows] == ["r_0", "r_1"]
    assert [r.logprob_start_len for r in rows] == [0, 1]
    assert all(r.params.temperature == 0 and r.return_logprob for r in rows)


def test_n_expands_prompt_major():
    rows, is_batch = expand(text=["x", "y"], sampling_params={"n": 2}, rid=["p", "q"])
    assert is_batch
    assert [(r.text, r.rid) for r in rows] == [
        ("x", "p_0"),
        ("x", "p_1"),
        ("y", "q_0"),
        ("y", "q_1"),
    ]
    rows, is_batch = expand(text="x", sampling_params={"n": 3})
    assert is_batch and len(rows) == 3


def test_mismatched_list_lengths_and_empty_prompts_are_rejected():
    with pytest.raises(InvalidRequestError):
        expand(input_ids=[[1], [2]], logprob_start_len=[0])
    with pytest.raises(InvalidRequestError):
        expand(input_ids=[])
    with pytest.raises(ValidationError):
        expand(input_ids=[1], text="both")


@pytest.mark.parametrize(
    "params",
    [
        {"foo": 1},
        {"top_k": 0},
        {"top_p": 0},
        {"temperature": -1},
        {"repetition_penalty": 1.1},
        {"stop": ["s"] * 33},
    ],
)
def test_invalid_sampling_params(params):
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(params)


def test_known_keys_at_neutral_values_are_accepted():
    p = SamplingParams.model_validate(
        {
            "min_new_tokens": 0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "top_k": -1,
            "stop": "END",
            "spaces_between_special_tokens": False,
            "max_new_tokens": None,
        }
    )
    assert p.stop_strings() == ("END",)
    assert p.max_new_tokens is None


def test_dumps_writes_non_finite_floats_as_null_like_orjson():
    out = json.loads(dumps({"a": [float("-inf"), 1.5, float("nan")], "b": (1, float("inf"))}))
    assert out == {"a": [None, 1.5, None], "b": [1, None]}


def test_validation_message_gives_a_checks_own_words_without_pydantics_prefix():
    from pydantic import BaseModel, field_validator  # noqa: PLC0415

    class Body(BaseModel):
        n: int

        @field_validator("n")
        @classmethod
        def _positive(cls, n: int) -> int:
            if n < 1:
                raise ValueError("n must be at least 1")
            return n

    with pytest.raises(ValidationError) as caught:
        Body.model_validate({"n": 0})
    assert validation_message(caught.value) == "n: n must be at least 1"
