"""One request row inside the engine: its queued form (`Job`) and its decode state (`Sequence`).

A `Sequence` owns everything per row that the batch loop must not mix up: the sampled ids and
their logprobs, the stop conditions (EOS ids, stop_token_ids, stop strings), the per-row
generator, and the finish reason in SGLang's shape. `result()` renders the finished row into the
`meta_info` fields of a /generate response (logprob rows `[logprob, id, text|null]`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from flywheel.engine.protocol import RowSpec
from flywheel.engine.sampling import SamplingConfig

if TYPE_CHECKING:
    from flywheel.engine.grammar import Grammar


class TokenizerLike(Protocol):
    # As transformers types it: a batch of id lists decodes to a list of strings.
    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(tokenizer: TokenizerLike, ids: list[int], skip_special_tokens: bool) -> str:
    """`tokenizer.decode` of one list of ids, which is one string."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


@dataclass
class Job:
    """A queued row: the request spec, its future, and an abort flag set by /abort_request."""

    spec: RowSpec
    future: Future[dict[str, Any]] = field(default_factory=Future)
    aborted: bool = False
    abort_message: str = "Aborted by /abort_request."
    probe: bool = False
    """Health probe: not counted in metrics."""
    created: float = field(default_factory=time.perf_counter)
    listener: Callable[[dict[str, Any]], None] | None = None
    """Streaming: called from the worker thread with the cumulative (unfinished) response
    object after every sampled token; the final object arrives through `future`."""
    grammar: Grammar | None = None
    """The compiled constraint of the request (json_schema / regex / ebnf / structural_tag)."""
    renormalized_logprobs: bool = False
    """Report the grammar-masked, renormalised logprobs (`engine.grammar_logprobs`
    "renormalized", as SGLang does) instead of the unmasked ones."""


class Sequence:
    """Decode state of one row in a batch."""

    def __init__(
        self,
        job: Job,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        eos_ids: frozenset[int],
        generator: torch.Generator,
    ):
        p = job.spec.params
        self.job = job
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.config = SamplingConfig(p.temperature, p.top_p, p.top_k, p.min_p)
        self.stop_ids = frozenset(p.stop_token_ids or ()) | (
            frozenset() if p.ignore_eos else eos_ids
        )
        self.stop_strings = p.stop_strings()
        self._stop_window = 4 * max((len(x) for x in self.stop_strings), default=0) + 8
        self.generator = generator
        self.grammar = job.grammar.matcher() if job.grammar is not None else None
        """Per-row matcher of the request's constraint; masks every sampled token."""
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[tuple[list[float], list[int]]] = []
        self.input_logprobs: list[float | None] = []
        self.input_top: list[tuple[list[float], list[int]] | None] = []
        self.output_ids_lp: list[list[float]] = []
        """Per output position: logprobs of `token_ids_logprob` (in request order)."""
        self.input_ids_lp: list[list[float] | None] = []
        self.finish_reason: dict[str, Any] | None = None
        self.weight_version = ""
        self._version_starts: list[tuple[str, int]] = []
        """(version, first output index) per weight version seen, when more than one."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.job.spec.return_logprob and self.job.spec.logprob_start_len >= 0

    def set_weight_version(self, version: str) -> None:
        """Stamp the weights that sample from now on (a swap while this row was paused in
        place records a span, reported as SGLang's `meta_info.weight_versions`)."""
        if self.weight_version and version != self.weight_version:
            if not self._version_starts:
                self._version_starts.append((self.weight_version, 0))
            self._version_starts.append((version, len(self.output_ids)))
        self.weight_version = version

    def check_abort(self) -> None:
        """Finish with `abort` if /abort_request (or a pause/update) flagged the row."""
        if self.job.aborted and not self.finished:
            self.finish_reason = {"type": "abort", "message": self.job.abort_message}

    def start(self) -> None:
        """Check the finish conditions that hold before any token is sampled."""
        if self.job.aborted:
            self.finish_reason = {"type": "abort", "message": self.job.abort_message}
        elif self.max_new_tokens == 0:
            self.finish_reason = {"type": "length", "length": 0}

    def append(self, token: int, logprob: float, tokenizer: TokenizerLike) -> None:
        """Record one sampled token and set the finish reason if it ends the row."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if self.grammar is not None and not self.grammar.accept(token):
            self.finish_reason = {
                "type": "abort",
                "message": f"token {token} is not allowed by the request's {self.grammar.kind}",
            }
            return
        if token in self.stop_ids or (self.grammar is not None and self.grammar.terminated):
            # a terminated grammar has accepted a stop token: SGLang finishes the row here
            self.finish_reason = {"type": "stop", "matched": token}
            return
        if self.stop_strings:
            # a new match ends in the last token; it spans at most 4 bytes (= tokens) per char
            tail = self.output_ids[-self._stop_window :]
            text = decode_text(tokenizer, tail, self.skip_special)
            for stop in self.stop_strings:
                if stop in text:
                    self.finish_reason = {"type": "stop", "matched": stop}
                    return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}
        elif self.job.aborted:
            self.finish_reason = {"type": "abort", "message": self.job.abort_message}

    @property
    def skip_special(self) -> bool:
        return self.job.spec.params.skip_special_tokens

    def text(self, tokenizer: TokenizerLike) -> str:
        """Detokenized output, trimmed at the matched stop token/string unless no_stop_trim."""
        matched = (self.finish_reason or {}).get("matched")
        trim = not self.job.spec.params.no_stop_trim
        ids = self.output_ids
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = decode_text(tokenizer, ids, self.skip_special)
        if trim and isinstance(matched, str):
            pos = text.find(matched)
            text = text[:pos] if pos >= 0 else text
        return text

    def result(self, tokenizer: TokenizerLike) -> dict[str, Any]:
        """The /generate response object of this row (e2e_latency is added by the caller)."""
        spec = self.job.spec
        meta: dict[str, Any] = {
            "id": spec.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if self._version_starts:
            bounds = [start for _, start in self._version_starts[1:]] + [len(self.output_ids)]
            meta["weight_versions"] = [
                {"version": v, "start": start, "end": end}
                for (v, start), end in zip(self._version_starts, bounds, strict=True)
            ]
        if spec.return_logprob:
            with_text = spec.return_text_in_logprobs
            out_rows = _rows(self.output_logprobs, self.output_ids, tokenizer, with_text)
            meta["output_token_logprobs"] = out_rows
            meta["output_token_logprobs_length"] = len(out_rows)
            if self.job.grammar is not None and not self.job.renormalized_logprobs:
                # A constrained row's logprobs are the unmasked log_softmax(logits / T) (not
                # renormalised over the grammar's tokens, as SGLang's are); the gateway reads
                # this to know (docs/engine-protocol.md, "POST /generate").
                meta["grammar_logprobs"] = "unmasked"
            start = spec.logprob_start_len
            in_ids = self.input_ids[start:] if start >= 0 else []
            meta["input_token_logprobs"] = _rows(self.input_logprobs, in_ids, tokenizer, with_text)
            if spec.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    _top(t, tokenizer, with_text) for t in self.output_top
                ]
                meta["input_top_logprobs"] = [_top(t, tokenizer, with_text) for t in self.input_top]
            wanted = spec.token_ids_logprob
            if wanted:
                meta["output_token_ids_logprobs"] = [
                    _top((lps, wanted), tokenizer, with_text) for lps in self.output_ids_lp
                ]
                meta["input_token_ids_logprobs"] = [
                    None if lps is None else _top((lps, wanted), tokenizer, with_text)
                    for lps in self.input_ids_lp
                ]
        return {
            "text": self.text(tokenizer),
            "output_ids": list(self.output_ids),
            "meta_info": meta,
        }


def _token_texts(ids: list[int], tokenizer: TokenizerLike, with_text: bool) -> list[str | None]:
    if not with_text:
        return [None] * len(ids)
    return [decode_text(tokenizer, [i], False) for i in ids]


def _rows(
    logprobs: Iterable[float | None], ids: list[int], tokenizer: TokenizerLike, with_text: bool
) -> list[list[Any]]:
    texts = _token_texts(ids, tokenizer, with_text)
    return [[lp, i, t] for lp, i, t in zip(logprobs, ids, texts, strict=True)]


def _top(
    top: tuple[list[float], list[int]] | None, tokenizer: TokenizerLike, with_text: bool
) -> list[list[Any]] | None:
    if top is None:
        return None
    return _rows(list(top[0]), top[1], tokenizer, with_text)
