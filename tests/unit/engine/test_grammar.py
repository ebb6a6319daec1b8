"""Constrained decoding on the embedded engine: the mask, the params, the logprob rule.

The logprob rule (docs/token-path.md, "Constrained tokens"): a constrained token is DRAWN from
the grammar-masked, renormalised distribution, and REPORTED with the model's unmasked
`log_softmax(logits / T)[token]`, so the trainer's recomputation (no mask) matches it.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from flywheel.core.errors import InvalidRequestError
from flywheel.engine.grammar import GrammarCompiler, mask_logprobs
from flywheel.engine.protocol import RowSpec, SamplingParams

YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed_tokens(compiler: GrammarCompiler, params: SamplingParams, prefix: list[int]) -> list:
    grammar = compiler.compile(params)
    assert grammar is not None
    row = grammar.matcher()
    for t in prefix:
        assert row.accept(t)
    lp = torch.zeros((1, compiler.vocab_size))
    masked = mask_logprobs(lp, [row])
    return masked[0].isfinite().nonzero().flatten().tolist()


def test_mask_allows_exactly_the_grammar_prefixes(compiler, tokenizer):
    # "yes" | "no": the first token must be a prefix of one of them
    first = allowed_tokens(compiler, SamplingParams(ebnf=YES_NO), [])
    assert sorted(tokenizer.decode([t]) for t in first) == ["n", "no", "y", "ye", "yes"]
    # after "ye" only "s" completes the word; after "yes" only EOS may follow
    ye = tokenizer.encode("ye")
    assert [
        tokenizer.decode([t]) for t in allowed_tokens(compiler, SamplingParams(ebnf=YES_NO), ye)
    ] == ["s"]
    done = tokenizer.encode("yes")
    assert allowed_tokens(compiler, SamplingParams(ebnf=YES_NO), done) == [tokenizer.eos_token_id]


def test_masked_rows_are_renormalised_and_free_rows_untouched(compiler, tokenizer):
    grammar = compiler.compile(SamplingParams(ebnf=YES_NO))
    assert grammar is not None
    vocab = compiler.vocab_size
    logits = torch.zeros((2, vocab))
    yes, n = tokenizer.encode("yes")[0], tokenizer.encode("n")[0]
    logits[0, yes] = math.log(3.0)  # e^log3 = 3: "yes" is 3x as likely as each other token
    logprobs = torch.log_softmax(logits, dim=-1)
    out = mask_logprobs(logprobs, [grammar.matcher(), None])
    # row 0 keeps 5 tokens with weights 3, 1, 1, 1, 1 (sum 7):
    # log(3/7) = -0.8473, log(1/7) = -1.9459
    assert out[0, yes].item() == pytest.approx(math.log(3 / 7), abs=1e-5)
    assert out[0, n].item() == pytest.approx(math.log(1 / 7), abs=1e-5)
    assert out[0].isfinite().sum().item() == 5
    assert torch.logsumexp(out[0], dim=-1).item() == pytest.approx(0.0, abs=1e-5)
    # row 1 has no grammar: the very same values, and the input was not changed in place
    assert torch.equal(out[1], logprobs[1])
    assert logprobs[0].isfinite().all()
    # no constrained row: the input itself comes back (no copy per decode step)
    assert mask_logprobs(logprobs, [None, None]) is logprobs


@pytest.mark.parametrize(
    ("params", "kind"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= (("}, "ebnf"),
        (
            {"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'},
            "structural_tag",
        ),
        ({"structural_tag": "[1, 2]"}, "structural_tag"),
    ],
)
def test_a_bad_grammar_is_an_invalid_request_naming_the_param(compiler, params, kind):
    with pytest.raises(InvalidRequestError, match=rf"Invalid grammar request: {kind}"):
        compiler.compile(SamplingParams(**params))


def test_a_bad_grammar_message_has_no_source_path_or_time(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(SamplingParams(json_schema='{"type": "nonsense"}'))
    message = str(err.value.message)
    # xgrammar says '[05:35:17] /project/cpp/json_schema_converter.cc:5082: Unsupported type ...'
    assert message.startswith("Invalid grammar request: json_schema could not be compiled: ")
    assert "nonsense" in message and ".cc:" not in message and "[" not in message, message


def test_at_most_one_grammar_param_and_none_means_unconstrained(compiler):
    with pytest.raises(ValidationError, match="Only one of regex, json_schema"):
        SamplingParams(regex="a", ebnf=YES_NO)
    with pytest.raises(ValidationError, match="Only one of regex, json_schema"):
        SamplingParams(json_schema="{}", structural_tag="{}")
    assert compiler.compile(SamplingParams()) is None
    assert not SamplingParams().constrained and SamplingParams(regex="a+").constrained


def _spec(rid: str, ids: list[int], **params) -> RowSpec:
    return RowSpec(
        rid=rid,
        text=None,
        input_ids=ids,
        params=SamplingParams(**params),
        return_logprob=True,
        logprob_start_len=-1,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )


def test_outputs_follow_the_grammar_and_a_bad_one_fails_at_submit(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("Answer:")
    schema = {"enum": ["red", "green", 7]}
    cases = {
        "re": {"regex": r"[a-c]{2,5}!"},
        "eb": {"ebnf": YES_NO},
        "js": {"json_schema": json.dumps(schema)},
    }
    jobs = {
        name: tiny_engine.submit(
            [_spec(f"g-{name}", prompt, max_new_tokens=40, temperature=1.0, sampling_seed=7, **p)]
        )[0]
        for name, p in cases.items()
    }
    out = {name: job.future.result(timeout=120) for name, job in jobs.items()}
    # the random-weight model would never write these by itself; the mask makes it
    assert re.fullmatch(r"[a-c]{2,5}!", out["re"]["text"]), out["re"]["text"]
    assert out["eb"]["text"] in ("yes", "no")
    # SGLang's default lets JSON carry whitespace around values (a random model pads with it)
    assert json.loads(out["js"]["text"]) in ("red", "green", 7), out["js"]["text"]
    for result in out.values():  # a complete grammar lets only EOS through: the row stops
        assert result["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": tiny_engine.tokenizer.eos_token_id,
        }
    with pytest.raises(InvalidRequestError, match="Invalid grammar request: regex"):
        tiny_engine.submit([_spec("g-bad", prompt, regex="[a-")])


REGEX = r"[xyz]{3,8}"
TEMPERATURE = 0.7


def _constrained_row(engine, rid: str) -> dict:
    """One regex-constrained row at T = 0.7, seed 11, answered by `engine`."""
    prompt = engine.tokenizer.encode("Pick letters:")
    spec = _spec(
        rid, prompt, max_new_tokens=12, temperature=TEMPERATURE, sampling_seed=11, regex=REGEX
    )
    (job,) = engine.submit([spec])
    result = job.future.result(timeout=120)
    assert re.fullmatch(REGEX, result["text"]), result["text"]
    return {"prompt": prompt, **result}


def _model_logprobs(runner, prompt: list[int], out_ids: list[int]) -> tuple[list, list]:
    """(unmasked, masked) logprob of each output token, computed directly from the model:
    `log_softmax(logits / T)[t]`, and the same renormalised over the tokens the regex allows."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + out_ids])
        logits = runner.model(ids).logits[0].float()  # (T, V)
    # position len(prompt) - 1 + k predicts out_ids[k]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out_ids)]  # (K, V)
    unmasked = torch.log_softmax(rows / TEMPERATURE, dim=-1)
    expected = unmasked.gather(1, torch.tensor(out_ids).unsqueeze(1)).squeeze(1).tolist()
    grammar = GrammarCompiler(runner.tokenizer, runner.vocab_size, runner.eos_ids).compile(
        SamplingParams(regex=REGEX)
    )
    assert grammar is not None
    row = grammar.matcher()
    masked = []
    for k, token in enumerate(out_ids):
        masked.append(mask_logprobs(unmasked[k : k + 1], [row])[0, token].item())
        row.accept(token)
    return expected, masked


def test_reported_logprobs_are_the_unmasked_model_distribution(tiny_engine, runner):
    """The documented rule, against a direct computation from the model's logits."""
    result = _constrained_row(tiny_engine, "g-lp")
    reported = [row[0] for row in result["meta_info"]["output_token_logprobs"]]
    expected, masked = _model_logprobs(runner, result["prompt"], result["output_ids"])
    assert reported == pytest.approx(expected, abs=1e-4)
    assert result["meta_info"]["grammar_logprobs"] == "unmasked"  # what the gateway reads
    # the masked (renormalised) logprob is another number: the rule is observable
    # a random model puts almost no mass on x/y/z, so renormalising raises every logprob
    assert all(m > e + 1.0 for m, e in zip(masked, expected, strict=True))


def test_renormalized_mode_reports_the_masked_logprob_as_sglang(tiny_model_dir, runner):
    """`engine.grammar_logprobs = "renormalized"`: the same draw (same seed), reported as SGLang
    0.5.23 reports it, log_softmax over the allowed tokens, and without the "unmasked" note;
    an unconstrained row is unaffected."""
    from flywheel.core.settings import EngineSettings  # noqa: PLC0415
    from flywheel.engine.worker import EngineWorker  # noqa: PLC0415

    settings = EngineSettings(
        model_path=str(tiny_model_dir),
        batch_wait_ms=5,
        context_length=256,
        grammar_logprobs="renormalized",
    )
    worker = EngineWorker(settings, tiny_model_dir).start()
    try:
        assert worker.wait_ready(120), worker.error
        result = _constrained_row(worker, "g-renorm")
        (free,) = worker.submit([_spec("g-free", result["prompt"], max_new_tokens=3)])
        free_meta = free.future.result(timeout=120)["meta_info"]
    finally:
        worker.close()
    reported = [row[0] for row in result["meta_info"]["output_token_logprobs"]]
    expected, masked = _model_logprobs(runner, result["prompt"], result["output_ids"])
    assert reported == pytest.approx(masked, abs=1e-4)
    assert all(r > e + 1.0 for r, e in zip(reported, expected, strict=True))
    assert "grammar_logprobs" not in result["meta_info"]
    assert "grammar_logprobs" not in free_meta


TEMP_TOOL = {
    "type": "function",
    "function": {
        "name": "temp",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "temp"}}])
def test_a_forced_call_ends_the_row_with_eos_well_before_max_new_tokens(tiny_engine, choice):
    """The gateway's forced-call grammar (one call: parallel calls off, or a named function)
    on the random-weight model, which writes whitespace wherever JSON allows it: the call must
    complete and the row end with the EOS the mask leaves as the only token, recorded like any
    sampled token. Bound: the call is `<tool_call>\\n{"name": "temp", "arguments": ` (42
    characters) + `{"unit": "c"}` (12 non-whitespace characters) + `}\\n</tool_call>` (14),
    with at most 7 whitespace gaps of <= 10 characters each (70), so <= 42 + 12 + 14 + 70 = 138
    tokens (a token has >= 1 character) + 1 EOS = 139 < 200. Without the bound on whitespace
    runs the model pads a gap until max_new_tokens (finish `length`)."""
    from types import SimpleNamespace  # noqa: PLC0415

    from flywheel.gateway.api.constraints import tool_call_constraint  # noqa: PLC0415
    from flywheel.gateway.api.parsers import parse_reply  # noqa: PLC0415

    body = SimpleNamespace(tool_choice=choice, tools=[TEMP_TOOL], parallel_tool_calls=False)
    params = tool_call_constraint(body, "hermes")
    eos = tiny_engine.tokenizer.eos_token_id
    prompt = tiny_engine.tokenizer.encode("Call:")
    specs = [
        _spec(
            f"g-call-{seed}",
            prompt,
            max_new_tokens=200,
            temperature=1.0,
            sampling_seed=seed,
            **params,
        )
        for seed in (1, 2, 3)
    ]
    for job in tiny_engine.submit(specs):
        result = job.future.result(timeout=120)
        meta = result["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": eos}, result["text"]
        ids = result["output_ids"]
        assert ids[-1] == eos and eos not in ids[:-1]
        assert meta["completion_tokens"] == len(ids) <= 139
        # the EOS is recorded like every other sampled token: its unmasked logprob, finite
        rows = meta["output_token_logprobs"]
        assert [r[1] for r in rows] == ids and math.isfinite(rows[-1][0]) and rows[-1][0] < 0
        (call,) = parse_reply(result["text"], tools_offered=True).tool_calls
        assert call["function"]["name"] == "temp"
        assert json.loads(call["function"]["arguments"]) in ({"unit": "c"}, {"unit": "f"})
