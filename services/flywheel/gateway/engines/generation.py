"""One engine result (`Generation`) and how a `/generate` answer becomes one.

`parse_generation` checks the answer's ids against its logprob rows and its weight-version
spans against the output tokens, for plain (pool.py) and streamed (stream.py) calls alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

from flywheel.core.errors import UpstreamError
from flywheel.core.versions import parse_weight_version

ENGINE_ABORTS = Counter(
    "flywheel_gateway_engine_aborts_total",
    "Generations the engine aborted (finish_reason abort: a weight update or pause that aborts "
    "running requests, an /abort_request): continued from their tokens (partial.py)",
    ["engine"],
)


@dataclass(frozen=True)
class Generation:
    """One engine result. `output_logprobs[i]` and `weight_version` belong to `output_ids[i]`."""

    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_type: str
    """SGLang finish type: stop | length | abort."""
    matched_eos: bool
    """True when generation stopped on a stop token that is part of `output_ids`."""
    weight_version: int
    prompt_tokens: int
    matched: int | str | None = None
    """The stop token id or stop string that ended generation (SGLang `finish_reason.matched`)."""
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per output token, the engine's most likely (logprob, token id) pairs; empty unless asked."""
    output_versions: list[int] = field(default_factory=list)
    """Per output token, the weight version that sampled it, from the engine's
    `meta_info.weight_versions` spans when the weights changed during the request (BUG-19);
    empty when they did not (every token is `weight_version`'s)."""
    parts: int = 1
    """Engine calls that sampled it: > 1 when an aborted generation was continued (partial.py;
    its `text` is then the parts' texts joined, decoded again by `calls.generate_n`)."""
    renormalized: bool = False
    """Sampled under a grammar by an engine whose logprobs are renormalised over the grammar's
    allowed tokens (log q, as SGLang reports them), not the model's unmasked log p: every output
    logprob is then recorded as such (`Sample.logprob_renormalized`, docs/token-path.md)."""

    def token_versions(self) -> list[int]:
        """The weight version of each output token, shape [len(output_ids)]."""
        return self.output_versions or [self.weight_version] * len(self.output_ids)


def span_versions(spans: Any, n: int) -> list[int]:
    """Per-token weight versions from SGLang's `meta_info.weight_versions` (0.5.19+: spans
    `{"version", "start", "end"}` over the output tokens, end exclusive, present when the
    weights changed mid-request). Example: spans 3 over [0, 40), 4 over [40, 100) ->
    40 x [3] + 60 x [4]. An absent or empty list gives [].

    Raises:
        UpstreamError: the spans do not cover the `n` output tokens in order without gaps.
    """
    if not spans:
        return []
    versions: list[int] = []
    try:
        for span in spans:
            if int(span["start"]) != len(versions) or int(span["end"]) < int(span["start"]):
                raise ValueError(f"span {span} does not start at token {len(versions)}")
            versions += [parse_weight_version(span["version"])] * (
                int(span["end"]) - int(span["start"])
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise UpstreamError(f"engine returned malformed weight_versions spans: {exc}") from exc
    if len(versions) != n:
        raise UpstreamError(
            f"engine's weight_versions spans cover {len(versions)} tokens of {n} output tokens"
        )
    return versions


GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")
"""SGLang's grammar sampling params (constrained decoding)."""


def renormalized_logprobs(meta: dict[str, Any], sampling_params: dict[str, Any]) -> bool:
    """Whether an answer's output logprobs are renormalised over a grammar's allowed tokens:
    the request had a grammar param and the engine did not say its logprobs are unmasked
    (`meta_info.grammar_logprobs == "unmasked"`, which the embedded engine sends; SGLang 0.5.23
    applies the grammar's vocabulary mask to the logits before its log-softmax and sends
    nothing). Example: {"json_schema": "{...}"} answered by SGLang -> True; by the embedded
    engine -> False; no grammar -> False."""
    if not any(sampling_params.get(key) for key in GRAMMAR_PARAMS):
        return False
    return meta.get("grammar_logprobs") != "unmasked"


def parse_generation(
    body: dict[str, Any], stop_token_ids: set[int], sampling_params: dict[str, Any] | None = None
) -> Generation:
    """Turn a `/generate` response into a `Generation`, checking ids against logprob rows.

    `sampling_params` (those of the request) tell whether it had a grammar
    (`renormalized_logprobs`); None = it had none.

    Raises:
        UpstreamError: the response lacks logprobs or they disagree with `output_ids`, or its
            weight-version spans do not cover the output tokens.
    """
    meta = body.get("meta_info") or {}
    ids = list(body.get("output_ids") or [])
    rows = meta.get("output_token_logprobs") or []
    if len(rows) != len(ids) or any(int(r[1]) != t for r, t in zip(rows, ids, strict=True)):
        raise UpstreamError("engine returned output_token_logprobs that do not match output_ids")
    logprobs = [float(r[0]) if r[0] is not None else float("-inf") for r in rows]
    finish = meta.get("finish_reason") or {}
    matched = finish.get("matched")
    matched_eos = (
        finish.get("type") == "stop"
        and isinstance(matched, int)
        and bool(ids)
        and ids[-1] == matched
        and matched in stop_token_ids
    )
    tops = [
        [(float(r[0]), int(r[1])) for r in row or [] if r[0] is not None]
        for row in meta.get("output_top_logprobs") or []
    ]
    return Generation(
        matched=matched if isinstance(matched, int | str) else None,
        output_top_logprobs=tops,
        output_ids=ids,
        output_logprobs=logprobs,
        text=body.get("text", ""),
        finish_type=finish.get("type", "abort"),
        matched_eos=matched_eos,
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        output_versions=span_versions(meta.get("weight_versions"), len(ids)),
        renormalized=renormalized_logprobs(meta, sampling_params or {}),
    )
