"""Constrained decoding through the engine's HTTP API, as SGLang serves it (real processes).

`/generate` accepts `json_schema` (a string), `regex`, `ebnf` and `structural_tag` in
`sampling_params` (at most one); an invalid grammar is a 400 `{"error": {"message"}}` before
anything is generated. The OpenAI routes map `response_format` (json_schema, json_object,
structural_tag) and the top-level `regex` / `ebnf` extras onto the same params.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _generate(url: str, **sampling) -> httpx.Response:
    body = {
        "text": "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n",
        "sampling_params": {"max_new_tokens": 60, "temperature": 0.7, "sampling_seed": 5}
        | sampling,
        "return_logprob": True,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=300)


def test_json_schema_output_is_valid_for_the_schema(smollm2_engine):
    resp = _generate(smollm2_engine, json_schema=json.dumps(PERSON))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_regex_and_ebnf_shape_the_output(smollm2_engine):
    pattern = r"(yes|no), because [a-z ]{5,30}\."
    out = _generate(smollm2_engine, regex=pattern).json()
    assert re.fullmatch(pattern, out["text"]), out["text"]
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    out = _generate(smollm2_engine, ebnf=ebnf).json()
    assert re.fullmatch(r"The answer is [0-9]+\.", out["text"]), out["text"]


def test_structural_tag_forces_a_tagged_tool_call(smollm2_engine):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": PERSON},
            "end": "}\n</tool_call>",
        },
    }
    out = _generate(smollm2_engine, structural_tag=json.dumps(tag)).json()
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", out["text"], re.DOTALL)
    assert m, out["text"]
    call = json.loads(m.group(1))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], PERSON)


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [
        ({"json_schema": '{"type": "object", "properties": '}, "json_schema"),
        ({"regex": "[unclosed"}, "regex"),
        ({"ebnf": "root ::= "}, "ebnf"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "Only one of regex, json_schema"),
    ],
)
def test_a_bad_or_doubled_grammar_is_a_400_before_generation(shared_live_engine, sampling, needle):
    resp = _generate(shared_live_engine, **sampling)
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert needle in (body["error"] if isinstance(body["error"], str) else body["error"]["message"])


def test_openai_routes_map_response_format_and_extras(smollm2_engine):
    client = openai.OpenAI(base_url=f"{smollm2_engine}/v1", api_key="local", max_retries=0)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    out = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=60,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=60,
        seed=3,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    done = client.completions.create(
        model="default",
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        extra_body={"regex": " (yes|no)"},
    )
    assert done.choices[0].text in (" yes", " no")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body={"regex": "a+"},
        )
    assert "Only one of regex, json_schema" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, extra_body={"ebnf": "root ::= (("}
        )
    assert err.value.body["message"].startswith("Invalid grammar request: ebnf")  # type: ignore[index]
