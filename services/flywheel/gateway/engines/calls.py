"""Engine calls of one turn: n choices for one prompt, and the context-window check before them.

Every API's turn ends here: the prompt ids go to the engines (pool.py, stream.py), each
result is cut at its first stop (stops.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flywheel.core.errors import InvalidRequestError
from flywheel.gateway.engines.generation import Generation
from flywheel.gateway.engines.stops import reconcile_stop
from flywheel.gateway.engines.stream import TEXT_SINK

if TYPE_CHECKING:
    from flywheel.gateway.deps import GatewayDeps


def _nth(sampling: dict[str, Any], i: int) -> dict[str, Any]:
    """Sampling params of choice i: a given seed is offset so the n choices differ."""
    if i and "sampling_seed" in sampling:
        return {**sampling, "sampling_seed": (sampling["sampling_seed"] + i) % 2**63}
    return sampling


async def generate_n(
    d: GatewayDeps,
    prompt: list[int],
    sampling: dict[str, Any],
    n: int,
    top_logprobs: int = 0,
    affinity: str = "",
) -> list[Generation]:
    """n engine calls for one prompt (distinct seeds when a seed is given). A request answered
    as its text is sampled (`engine_stream.TEXT_SINK` set, n = 1) streams its engine call."""
    extra = {"top_logprobs_num": top_logprobs} if top_logprobs else {}
    sink = TEXT_SINK.get()
    if sink is not None and n == 1 and hasattr(d.engines, "generate_stream"):
        gens = [await d.engines.generate_stream(prompt, sampling, affinity, on_text=sink, **extra)]
    else:
        gens = await asyncio.gather(
            *[d.engines.generate(prompt, _nth(sampling, i), affinity, **extra) for i in range(n)]
        )
    eos = d.renderer.eos_token_id
    return [
        reconcile_stop(
            _whole_text(gen, d.renderer.decode),
            d.renderer.decode,
            sampling.get("stop") or [],
            () if eos is None else (eos,),
        )
        for gen in gens
    ]


def _whole_text(gen: Generation, decode: Callable[[list[int]], str]) -> Generation:
    """A continued generation (`gen.parts` > 1) with its text decoded from all its ids (a
    character split across two parts reads whole), cut before a matched stop string as the
    engine trims it; any other generation as it is."""
    if gen.parts == 1:
        return gen
    text = decode(gen.output_ids)
    if gen.finish_type == "stop" and isinstance(gen.matched, str) and gen.matched in text:
        text = text[: text.find(gen.matched)]
    return dataclasses.replace(gen, text=text)


def check_context(
    d: GatewayDeps,
    prompt: list[int],
    sampling: dict[str, Any],
    *,
    capped_by_default: bool = False,
    param: str = "messages",
) -> None:
    """Refuse a prompt whose completion cannot fit the context window.

    `capped_by_default`: the client set no max_tokens, so `sampling["max_new_tokens"]` is the
    gateway's default; it is lowered in place to what is left of the window (context - prompt
    - 1, the engine's own clamp) instead of refusing.

    Raises:
        InvalidRequestError: `context_length_exceeded`, naming `param`: the prompt leaves no
            room, or the client's max_tokens does not fit.
    """
    limit = d.context_length
    room = limit - len(prompt) - 1  # SGLang clamps max_new_tokens to context - input - 1
    if capped_by_default and room > 0:
        sampling["max_new_tokens"] = min(sampling["max_new_tokens"], room)
    if sampling["max_new_tokens"] > room:
        asked = "" if capped_by_default else f" + max_tokens ({sampling['max_new_tokens']})"
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens){asked} must stay below the context window of "
            f"{limit} tokens; shorten the conversation"
            + ("" if capped_by_default else " or lower max_tokens"),
            param=param,
            code="context_length_exceeded",
        )
