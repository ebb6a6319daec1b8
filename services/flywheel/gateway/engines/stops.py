"""Ids, logprobs and finish reason reconciled with the stops the request asked for (BUG-10).

An engine that accepts several tokens per step (speculative decoding) can run past a stop:
SGLang once checked the token cap before the stops, so a block that completed a stop and crossed
the cap finished as `length` with tokens after the stop; vLLM cut the text at a stop string but
kept the ids and logprobs after it. The gateway keeps what a correct engine returns: the ids up to
and including the token that completes the first stop (a stop token, or the token whose text
completes a stop string), `finish_reason` "stop" with that stop as `matched`. Each generation cut
or relabelled this way is counted and logged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence

from prometheus_client import Counter

from flywheel.gateway.engines.generation import Generation

log = logging.getLogger(__name__)

STOP_OVERRUNS = Counter(
    "flywheel_gateway_stop_overruns_total",
    "Generations the engine returned past a stop (cut at the stop: tokens_after_stop) or as "
    "'length' although their last token completed a stop (relabelled: finish_relabelled)",
    ["kind"],
)


def _first_string_stop(
    ids: Sequence[int], strings: Collection[str], decode: Callable[[list[int]], str]
) -> tuple[int, str] | None:
    """(k, s): the shortest prefix `ids[:k]` whose text holds stop string `s`; None if the
    whole text holds none. Two decodes when the last token completes the stop (a correct
    engine's answer), else a binary search over k (a prefix's text grows with k): O(log n)."""

    def found(k: int) -> str | None:
        text = decode(list(ids[:k]))
        hits = [(text.find(s), s) for s in strings if s in text]
        return min(hits)[1] if hits else None

    if not strings or (last := found(len(ids))) is None:
        return None
    if found(len(ids) - 1) is None:  # the usual case: the last token completes the stop
        return len(ids), last
    lo, hi = 1, len(ids) - 1  # found(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if found(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return hi, found(hi) or ""


def reconcile_stop(
    gen: Generation,
    decode: Callable[[list[int]], str],
    stops: Collection[str],
    stop_ids: Collection[int],
) -> Generation:
    """`gen` cut after the token that completes its first stop, or `gen` itself.

    Args:
        gen: the engine's generation (`output_ids`, per-token lists of the same length).
        decode: token ids -> text (special tokens skipped).
        stops: the request's stop strings (SGLang `sampling_params.stop`).
        stop_ids: ids that end a turn (the tokenizer's EOS; the gateway never sends
            `ignore_eos`).

    Example: ids [10, 11, EOS, 20, 21], finish "length" -> ids [10, 11, EOS], finish "stop",
    matched EOS, logprobs and versions cut to 3 rows. Ids whose text reads "1, 2 ha ha ha more"
    with stop " ha ha ha" -> cut after the token that completes " ha ha ha", text "1, 2".
    """
    ids = gen.output_ids
    cut: int | None = None
    matched: int | str | None = None
    for k, t in enumerate(ids):  # the last one too: SGLang checks the cap before the stops
        if t in stop_ids:
            cut, matched = k + 1, t
            break
    strings = set(stops) | ({gen.matched} if isinstance(gen.matched, str) else set())
    hit = _first_string_stop(ids[:cut] if cut else ids, {s for s in strings if s}, decode)
    if hit is not None:
        cut, matched = hit
    if cut is None or matched is None:
        return gen
    if cut == len(ids):  # nothing after the stop: only a wrong "length" to put right
        if gen.finish_type == "stop":
            return gen
        STOP_OVERRUNS.labels("finish_relabelled").inc()
        log.warning(
            "engine finished with %r on the token that completes stop %r; recorded as 'stop'",
            gen.finish_type,
            matched,
        )
        text = gen.text
        if isinstance(matched, str) and matched in text:  # the engine did not trim it
            text = text[: text.find(matched)]
        return dataclasses.replace(
            gen,
            finish_type="stop",
            matched=matched,
            text=text,
            matched_eos=isinstance(matched, int),
        )
    STOP_OVERRUNS.labels("tokens_after_stop").inc()
    log.warning(
        "engine returned %d tokens after stop %r (finish %r); cut at the stop",
        len(ids) - cut,
        matched,
        gen.finish_type,
    )
    text = decode(list(ids[:cut]))
    if isinstance(matched, str):
        text = text[: text.find(matched)]
    return dataclasses.replace(
        gen,
        output_ids=ids[:cut],
        output_logprobs=gen.output_logprobs[:cut],
        text=text,
        finish_type="stop",
        matched=matched,
        matched_eos=isinstance(matched, int),
        output_top_logprobs=gen.output_top_logprobs[:cut],
        output_versions=gen.output_versions[:cut],
    )
