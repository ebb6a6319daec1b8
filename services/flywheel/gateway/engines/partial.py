"""Partial rollouts: a generation the engine aborted keeps its tokens and continues.

An SGLang engine aborts the requests in flight when weights are pushed with
`abort_all_requests` or under `/pause_generation {"mode": "abort"}` (the RL weight-sync flow:
pause, update, continue); each aborted call still answers 200 with its partial output and
`finish_reason.type == "abort"` (docs: SGLang HTTP API section 2.6). Instead of sampling the turn
again from scratch, the gateway sends the prompt ids followed by the tokens sampled so far
(`input_ids`) with the tokens still allowed (`max_new_tokens - done`) and joins the parts: the
recorded turn holds every token exactly as sampled, each with the logprob and the weight
version of the part that sampled it (verl's partial rollouts). A part's first token is sampled
from the same context an uninterrupted generation would have had, so the joined tokens are an
on-policy trajectory whose per-token versions say which weights drew which token.

Continuing is exact only when the sampling distribution at a position depends on the context
alone. A request with a grammar (`json_schema`, `regex`, `ebnf`, `structural_tag`) or an output
penalty (`frequency_penalty`, `presence_penalty`, `repetition_penalty`) carries state over its
own output tokens that a new call would start afresh, so such a generation is sampled again
from the prompt (its partial tokens discarded, counted as `restarted`).

Every part after an abort is counted in `flywheel_gateway_partial_rollouts_total` and logged;
a generation aborted more than `MAX_ABORTS` times is an UpstreamError and nothing is recorded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from flywheel.core.errors import UpstreamError
from flywheel.gateway.engines.generation import ENGINE_ABORTS, Generation

log = logging.getLogger(__name__)

PARTIAL_ROLLOUTS = Counter(
    "flywheel_gateway_partial_rollouts_total",
    "Generations the engine aborted mid-way (a weight update or a pause that aborts), by what "
    "the gateway did: continued (the tokens kept, the rest sampled under the weights now "
    "served) or restarted (a grammar or output penalty: sampled again from the prompt)",
    ["outcome"],
)
MAX_ABORTS = 3
"""Aborts of one generation tolerated; one more is an UpstreamError (nothing recorded)."""
STATEFUL_SAMPLING = ("json_schema", "regex", "ebnf", "structural_tag")
"""Sampling params whose state spans the output tokens: such a generation cannot continue."""
DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's `max_new_tokens` when a request sets none."""
_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}

Call = Callable[[list[int], dict[str, Any]], Awaitable[tuple[str, Generation]]]
"""One engine call: (input ids, sampling params) -> (engine URL, its Generation)."""


def continuable(sampling: dict[str, Any]) -> bool:
    """Whether a generation under `sampling` can continue from its partial tokens: no grammar
    and no output penalty (their state covers the output tokens already sampled)."""
    if any(sampling.get(key) for key in STATEFUL_SAMPLING):
        return False
    return all(float(sampling.get(key, off)) == off for key, off in _PENALTIES.items())


def rest_of(sampling: dict[str, Any], done: int) -> dict[str, Any]:
    """Sampling params of the part after `done` sampled tokens: `max_new_tokens` and
    `min_new_tokens` lowered by `done` (not below 0), a given seed offset by `done` (the part
    does not replay the first part's random draws).

    Example: {"max_new_tokens": 64, "min_new_tokens": 8, "sampling_seed": 7}, done 40 ->
    {"max_new_tokens": 24, "min_new_tokens": 0, "sampling_seed": 47}.
    """
    cap = int(sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    rest = {**sampling, "max_new_tokens": max(cap - done, 0)}
    if "min_new_tokens" in sampling:
        rest["min_new_tokens"] = max(int(sampling["min_new_tokens"]) - done, 0)
    if "sampling_seed" in sampling:
        rest["sampling_seed"] = (int(sampling["sampling_seed"]) + done) % 2**63
    return rest


def join(parts: list[Generation], max_new_tokens: int) -> Generation:
    """One Generation from consecutive parts of a generation (every part but the last aborted).

    Ids, logprobs, top logprobs and per-token weight versions are concatenated in order; the
    finish (type, matched stop, EOS) and weight version are the last part's, the prompt length
    the first's. The text is the parts' texts joined (the caller that holds the tokenizer
    decodes the joined ids again, `calls.generate_n`). A last part that was aborted with no
    tokens left to sample (`max_new_tokens` reached) finishes as `length`.

    Example: part 1 ids [5, 6] at version 3 (aborted), part 2 ids [7, 2] at version 4 (stop on
    2) -> ids [5, 6, 7, 2], versions [3, 3, 4, 4], finish stop, weight_version 4.

    Raises:
        ValueError: `parts` is empty.
    """
    if not parts:
        raise ValueError("join needs at least one part")
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    ids = [t for p in parts for t in p.output_ids]
    finish = last.finish_type
    if finish == "abort" and len(ids) >= max_new_tokens:
        finish = "length"
    tops = [row for p in parts for row in (p.output_top_logprobs or [[]] * len(p.output_ids))]
    return dataclasses.replace(
        last,
        output_ids=ids,
        output_logprobs=[lp for p in parts for lp in p.output_logprobs],
        text="".join(p.text for p in parts),
        finish_type=finish,
        prompt_tokens=parts[0].prompt_tokens,
        output_top_logprobs=tops if any(tops) else [],
        output_versions=[v for p in parts for v in p.token_versions()],
        parts=len(parts),
    )


async def generate_partial(
    call: Call, input_ids: list[int], sampling: dict[str, Any], *, restart: bool = True
) -> tuple[Generation, int]:
    """Run `call` until the generation is not aborted, continuing it after each abort.

    Args:
        call: one engine call (plain or streamed; a streamed one sends its own text on).
        input_ids: the prompt ids.
        sampling: SGLang sampling params (`max_new_tokens` unset = SGLang's 128).
        restart: a generation that cannot continue (`continuable`) may be sampled again from
            the prompt; False (a streamed call: its text is shown as it comes) makes such an
            abort an UpstreamError once a token was sampled.

    Returns:
        (the joined Generation, number of parts).

    Raises:
        UpstreamError: the generation was aborted more than `MAX_ABORTS` times.
        InvalidRequestError, UpstreamError: from `call`.
    """
    keep = continuable(sampling)
    cap = int(sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    parts: list[Generation] = []
    for aborts in range(MAX_ABORTS + 1):
        done = [t for p in parts for t in p.output_ids]
        url, gen = await call(input_ids + done, rest_of(sampling, len(done)) if done else sampling)
        parts.append(gen)
        if gen.finish_type != "abort":
            return join(parts, cap), len(parts)
        ENGINE_ABORTS.labels(url).inc()
        if aborts == MAX_ABORTS:
            break
        if keep and len(done) + len(gen.output_ids) >= cap:  # nothing left to sample
            return join(parts, cap), len(parts)
        if not keep and not restart and gen.output_ids:  # its text was shown
            raise UpstreamError(
                "the engine aborted the streamed generation (a weight update or an abort "
                "request) and a generation with a grammar or an output penalty cannot continue "
                "from its tokens; nothing was recorded, send it again"
            )
        outcome = "continued" if keep else "restarted"
        PARTIAL_ROLLOUTS.labels(outcome).inc()
        log.warning(
            "engine %s aborted a generation after %d tokens (%d in all); %s",
            url,
            len(gen.output_ids),
            len(done) + len(gen.output_ids),
            "continuing it from its tokens" if keep else "sampling it again (grammar or penalty)",
        )
        if not keep:
            parts = []
    raise UpstreamError(
        f"the engine aborted the generation {MAX_ABORTS + 1} times (weight updates or abort "
        "requests); nothing was recorded, send the request again"
    )
