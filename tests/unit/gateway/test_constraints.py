"""A chat turn's tool_choice / response_format as SGLang grammar params (api/constraints.py).

The params are checked against xgrammar itself (the grammar library SGLang and the embedded
engine compile them with): a well-formed call in the gateway's tool-call format is accepted,
malformed or wrong-tool text is rejected, and what is accepted parses back as a tool call.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from flywheel.core.errors import InvalidRequestError
from flywheel.gateway.api.constraints import MAX_WHITESPACE, grammar_params
from flywheel.gateway.api.parsers import parse_reply
from flywheel.gateway.api.schemas import ChatCompletionRequest

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
U = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> xgr.GrammarCompiler:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))


def _params(**body) -> dict[str, str]:
    return grammar_params(
        ChatCompletionRequest.model_validate({"model": "m", "messages": U, **body}), "hermes"
    )


def _accepts(compiler: xgr.GrammarCompiler, params: dict[str, str], text: str) -> bool:
    ((kind, value),) = params.items()
    if kind == "structural_tag":
        grammar = compiler.compile_structural_tag(xgr.StructuralTag.model_validate_json(value))
    else:
        grammar = compiler.compile_json_schema(value)
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_required_forces_hermes_calls_valid_for_the_tool_schema(compiler):
    params = _params(tools=[ADD, NOW], tool_choice="required")
    assert list(params) == ["structural_tag"]
    good = _call("add", {"a": 1, "b": 2})
    assert _accepts(compiler, params, good)
    assert _accepts(compiler, params, _call("now", {}))
    assert _accepts(compiler, params, good + "\n" + _call("now", {"tz": "UTC"}))  # parallel
    assert not _accepts(compiler, params, "Sure! " + good)  # nothing before the call
    assert not _accepts(compiler, params, _call("add", {"a": "one", "b": 2}))  # schema
    assert not _accepts(compiler, params, _call("add", {"a": 1}))  # required b missing
    assert not _accepts(compiler, params, _call("mul", {"a": 1, "b": 2}))  # not a tool
    assert not _accepts(compiler, params, "")  # at least one call
    # what the grammar accepts is what the gateway's parser reads as a call
    parsed = parse_reply(good, tools_offered=True)
    assert parsed.content is None or parsed.content == ""
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ] == [("add", {"a": 1, "b": 2})]


def test_one_call_when_parallel_calls_are_off_or_a_function_is_named(compiler):
    single = _params(tools=[ADD, NOW], tool_choice="required", parallel_tool_calls=False)
    good = _call("add", {"a": 1, "b": 2})
    assert _accepts(compiler, single, good)
    assert not _accepts(compiler, single, good + "\n" + good)
    named = _params(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "now"}})
    assert _accepts(compiler, named, _call("now", {}))
    assert not _accepts(compiler, named, good)


def test_auto_none_and_text_add_no_constraint():
    assert _params(tools=[ADD]) == {}
    assert _params(tools=[ADD], tool_choice="auto") == {}
    assert _params(tools=[ADD], tool_choice="none", response_format={"type": "text"}) == {}


def test_response_format_becomes_a_json_schema_param(compiler):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = _params(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    assert json.loads(params["json_schema"]) == schema
    assert _accepts(compiler, params, '{"x": 1.5}') and not _accepts(compiler, params, '{"y": 1}')
    assert _params(response_format={"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    assert _params(regex="[0-9]+") == {"regex": "[0-9]+"}


def test_json_parser_forces_a_bare_call_object(compiler):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": U, "tools": [ADD, NOW], "tool_choice": "required"}
    )
    params = grammar_params(body, "json")
    assert _accepts(compiler, params, '{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert not _accepts(compiler, params, '{"name": "add", "arguments": {"a": 1}}')
    assert not _accepts(compiler, params, '{"name": "mul", "arguments": {}}')


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "'mul', which is not in tools ('add')",
        ),
        (
            {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "tool_choice and response_format each constrain the output",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
            "needs",
        ),
    ],
)
def test_impossible_or_doubled_constraints_are_refused(body, param, needle):
    with pytest.raises(InvalidRequestError) as err:
        _params(**body)
    assert err.value.param == param and needle in str(err.value)


def test_a_forced_call_may_end_right_after_it_even_after_a_newline(tiny_model_dir):
    """After a complete call the only ways on are EOS, or a newline then EOS or another call:
    a newline must never force a second call (the row would then run to max_tokens)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tok.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    call = _call("add", {"a": 2, "b": 3})
    parallel = {"tools": [ADD, NOW], "tool_choice": "required"}
    single = {"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False}
    cases = [(parallel, call), (parallel, call + "\n"), (parallel, call + "\n" + call + "\n")]
    for body, text in [*cases, (single, call)]:
        ((_, value),) = _params(**body).items()
        grammar = compiler.compile_structural_tag(xgr.StructuralTag.model_validate_json(value))
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(text), (body, text)
        assert matcher.accept_token(eos) and matcher.is_terminated(), (body, text)
        # what such a row reads back as: only the calls, no text around them
        parsed = parse_reply(text, tools_offered=True)
        assert not parsed.content and len(parsed.tool_calls) == text.count("<tool_call>")


def _pretty_call(name: str, args: dict) -> str:
    """A call whose arguments are `json.dumps(args, indent=4)`, as models tend to write them."""
    return _call(name, args).replace(json.dumps(args), json.dumps(args, indent=4))


def test_whitespace_inside_a_forced_calls_arguments_comes_in_bounded_runs(compiler):
    """A run of more than MAX_WHITESPACE (10) whitespace characters between the arguments' JSON
    tokens is refused, so a model that starts writing newlines there must go on with the call
    (unbounded, such a run went on until max_tokens); pretty-printed JSON stays allowed."""
    assert MAX_WHITESPACE == 10
    head = '<tool_call>\n{"name": "add", "arguments": {'
    tail = '"a": 1, "b": 2}}\n</tool_call>'
    for body in (
        {"tools": [ADD, NOW], "tool_choice": "required"},
        {"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": [ADD, NOW], "tool_choice": {"type": "function", "function": {"name": "add"}}},
    ):
        params = _params(**body)
        assert _accepts(compiler, params, head + "\n" * 10 + tail), body
        assert not _accepts(compiler, params, head + "\n" * 11 + tail), body
        assert not _accepts(compiler, params, head + " " * 6 + "\n" * 5 + tail), body  # 11
        assert _accepts(compiler, params, _pretty_call("add", {"a": 1, "b": 2})), body
    # indent=4 at depth 2: runs of a newline and 8 spaces (9 characters) are allowed
    params = _params(tools=[ADD, NOW], tool_choice="required")
    assert _accepts(compiler, params, _pretty_call("now", {"when": {"day": 1}}))
    # the json parser's bare call object: the same bound
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": U, "tools": [ADD], "tool_choice": "required"}
    )
    params = grammar_params(body, "json")
    assert list(params) == ["structural_tag"]
    bare = '{"name": "add", "arguments": {WS"a": 1, "b": 2}}'
    assert _accepts(compiler, params, bare.replace("WS", " " * 10))
    assert not _accepts(compiler, params, bare.replace("WS", " " * 11))
