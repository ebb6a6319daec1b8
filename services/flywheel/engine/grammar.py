"""Constrained decoding: SGLang's grammar sampling params compiled and applied with xgrammar.

A /generate row may carry at most one of `json_schema` (a JSON Schema as a string), `regex`,
`ebnf` (xgrammar's EBNF, as SGLang's default xgrammar backend reads it) or `structural_tag`
(xgrammar's structural-tag JSON, e.g. a tool call's fixed begin/end strings around a JSON
schema). `GrammarCompiler.compile()` turns the one given into an xgrammar `CompiledGrammar`
before the row is queued, so an invalid grammar is a 400 and nothing is generated. Each row then
gets its own `RowGrammar` (an xgrammar `GrammarMatcher`): before every decode step
`mask_logprobs()` fills one bitmask row per constrained row and sets the logprobs of disallowed
tokens to -inf; after sampling `RowGrammar.accept()` advances the matcher. A matcher that has
accepted a stop token (EOS) is terminated and the row finishes, as in SGLang.

Which distribution is sampled and which is reported (docs/token-path.md, "Constrained tokens"):
the token is drawn from `softmax(masked(logits / T))` (renormalised over the allowed tokens,
then truncated by top-k / top-p / min-p), while the logprob the engine reports is the model's
UNMASKED `log_softmax(logits / T)[token]`, the same rule as for top-k / top-p truncation. So the
trainer, which recomputes logprobs without any mask, gets a ratio of exactly 1 at the sampling
weights. SGLang instead reports the logprob after its vocabulary mask (renormalised).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr
from torch import Tensor

from flywheel.core.errors import InvalidRequestError

_SOURCE_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")
"""The `[hh:mm:ss] /path/to/file.cc:line: ` xgrammar's C++ puts before its messages."""

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
"""SGLang's constrained-decoding sampling params; at most one per request."""


@dataclass(frozen=True)
class Grammar:
    """One compiled constraint, shared by every row (and `n` sample) of a request."""

    kind: str
    """One of `GRAMMAR_KEYS`."""
    compiled: xgr.CompiledGrammar

    def matcher(self) -> RowGrammar:
        """A fresh matcher at the grammar's start (one per row)."""
        return RowGrammar(self.kind, xgr.GrammarMatcher(self.compiled))


class RowGrammar:
    """The grammar state of one row: which tokens may come next, advanced per sampled token."""

    def __init__(self, kind: str, matcher: xgr.GrammarMatcher):
        self.kind = kind
        self._matcher = matcher

    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ((B, ceil(V/32)) int32 bits)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (never after a mask)."""
        return bool(self._matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles grammar params against one tokenizer; thread-safe, results cached by text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        """
        Args:
            tokenizer: the served model's Hugging Face tokenizer.
            vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
            stop_token_ids: the ids that end a row (EOS); a complete grammar allows only these.
        """
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, params: Any) -> Grammar | None:
        """The constraint in a request's sampling params, or None when it has none.

        Args:
            params: `protocol.SamplingParams` (at most one grammar key set; the model checks).

        Raises:
            InvalidRequestError: the grammar does not parse (bad JSON schema, regex, EBNF or
                structural tag); the message names the param and xgrammar's reason (without
                the time and C++ source location xgrammar puts before it).
        """
        for kind in GRAMMAR_KEYS:
            text = getattr(params, kind)
            if text is not None:
                try:
                    return Grammar(kind, self._compile(kind, text))
                except (RuntimeError, ValueError, TypeError) as e:
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                    reason = _SOURCE_PREFIX.sub("", reason)
                    raise InvalidRequestError(
                        f"Invalid grammar request: {kind} could not be compiled: {reason}"
                    ) from e
        return None

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            return self._compiler.compile_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        if kind == "ebnf":
            return self._compiler.compile_grammar(text)
        tag = json.loads(text)
        if not isinstance(tag, dict):
            raise ValueError("structural_tag must be a JSON object")
        return self._compiler.compile_structural_tag(xgr.StructuralTag.model_validate(tag))


def mask_logprobs(logprobs: Tensor, grammars: list[RowGrammar | None]) -> Tensor:
    """The distribution to sample from: constrained rows masked to their allowed tokens.

    Args:
        logprobs: (B, V) float32 `log_softmax(logits / T)` per row (left untouched).
        grammars: B entries, None for unconstrained rows.

    Returns:
        (B, V) float32: `logprobs` itself when no row is constrained; otherwise a copy whose
        constrained rows are `log_softmax` over the allowed tokens (-inf elsewhere), e.g. allowed
        logprobs [-1.0, -2.0] of a row become [-1.0 - log(e^-1 + e^-2), ...] = [-0.313, -1.313].
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logprobs
    vocab = logprobs.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)  # (R, ceil(V/32)) int32
    for k, i in enumerate(rows):
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill(bitmask, k)
    index = torch.tensor(rows, dtype=torch.long, device=logprobs.device)
    constrained = logprobs.index_select(0, index)  # (R, V) copy
    xgr.apply_token_bitmask_inplace(constrained, bitmask.to(logprobs.device), vocab_size=vocab)
    out = logprobs.clone()
    out[index] = torch.log_softmax(constrained, dim=-1)
    return out
