"""Fidelity check: re-score a recorded Sample through an engine and compare (docs/token-path.md).

One prefill-only `/generate` call (`max_new_tokens: 0`, `return_logprob`,
`logprob_start_len = 0`) scores every recorded token under the serving weights. Row k + 1 of
`input_token_logprobs` is the logprob of `token_ids[k + 1]` (row 0 is SGLang's null row), so the
rows must echo the recorded ids exactly, and on sampled tokens (loss mask 1) the logprobs must
equal the recorded rollout logprobs within a tolerance.

A Sample whose tokens were sampled under several weight versions (a push mid-generation, a
continued partial rollout) is checked one version at a time: `versions` restricts the logprob
comparison to the sampled tokens of those versions, with the engine serving those weights.

Prompt logprobs are untempered, so logprobs are compared only for Samples drawn at temperature
1 or greedily (0); at other temperatures the check compares ids only and says so. Tokens marked
in `logprob_renormalized` (an SGLang engine under a grammar recorded log q, not log p) are
compared by id only and counted (`renormalized_tokens`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import httpx

from flywheel._proto import sample_pb2


@dataclass(frozen=True)
class FidelityReport:
    ids_match: bool
    """Every recorded token id came back in the engine's rows, in order."""
    logprobs_compared: bool
    max_abs_logprob_diff: float
    """Over sampled tokens; 0.0 when not compared."""
    sampled_tokens: int
    """Sampled tokens whose logprobs were compared (those of `versions` when given)."""
    renormalized_tokens: int = 0
    """Sampled tokens of `versions` left out of the comparison: their recorded logprob is
    renormalised over a grammar's allowed tokens (`Sample.logprob_renormalized`)."""

    def ok(self, tol: float) -> bool:
        return self.ids_match and (not self.logprobs_compared or self.max_abs_logprob_diff <= tol)


def check_fidelity(
    sample: sample_pb2.Sample,
    engine_url: str,
    timeout_s: float = 600.0,
    versions: Collection[int] | None = None,
) -> FidelityReport:
    """Re-score `sample` on the engine at `engine_url` and compare ids and logprobs.

    The engine must serve the weights that produced the compared tokens (their
    `weight_versions`).

    Args:
        timeout_s: seconds to wait for the engine's answer (a busy engine queues the prefill).
        versions: compare only the sampled tokens of these weight versions; None = all.

    Raises:
        httpx.HTTPError: the engine call failed (httpx.TimeoutException after `timeout_s`).
    """
    ids = list(sample.token_ids)
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    }
    resp = httpx.post(f"{engine_url.rstrip('/')}/generate", json=body, timeout=timeout_s)
    resp.raise_for_status()
    rows = resp.json()["meta_info"]["input_token_logprobs"]
    ids_match = len(rows) == len(ids) and all(
        int(r[1]) == t for r, t in zip(rows, ids, strict=True)
    )
    temperature = sample.sampling.temperature
    comparable = ids_match and temperature in (0.0, 1.0)
    renormalized = list(sample.logprob_renormalized) or [0] * len(ids)
    sampled = [
        k
        for k in range(1, len(ids))
        if sample.loss_mask[k] and (versions is None or sample.weight_versions[k] in versions)
    ]
    compared = [k for k in sampled if not renormalized[k]]
    diffs = [
        abs(float(rows[k][0]) - sample.rollout_logprobs[k])
        for k in compared
        if ids_match and rows[k][0] is not None
    ]
    return FidelityReport(
        ids_match=ids_match,
        logprobs_compared=comparable,
        max_abs_logprob_diff=max(diffs, default=0.0) if comparable else 0.0,
        sampled_tokens=len(compared),
        renormalized_tokens=len(sampled) - len(compared),
    )
