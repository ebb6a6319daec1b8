"""Torch-free facts and checks about one Sample that the trainer relies on."""

from __future__ import annotations

import math
import re

from flywheel._proto import sample_pb2
from flywheel.core.errors import ContractError

STEP_REWARD = re.compile(r"step/(\d+)")
"""Key of a per-turn score in `Sample.rewards` (reward/scoring.py: the step judge's score of the
k-th assistant message, 0-based)."""


def check_trainable(sample: sample_pb2.Sample, vocab_size: int | None = None) -> None:
    """The per-token invariants the trainer relies on.

    Args:
        vocab_size: rows of the policy's embedding; token ids must lie in [0, vocab_size)
            (None: not checked).

    Raises:
        ContractError: per-token arrays of different lengths; a token id outside the
            vocabulary; a loss token at position 0 (it has no context to be scored from); a
            loss token whose rollout logprob is not a finite value <= 0; a reward (the combined
            one or a component) that is NaN or infinite.
    """
    n = len(sample.token_ids)
    lengths = (len(sample.loss_mask), len(sample.rollout_logprobs), len(sample.weight_versions))
    if any(length != n for length in lengths):
        raise ContractError(
            f"Sample {sample.sample_id!r}: token_ids has {n} entries, loss_mask/rollout_logprobs/"
            f"weight_versions have {lengths}"
        )
    if vocab_size is not None and n:
        low, high = min(sample.token_ids), max(sample.token_ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ContractError(
                f"Sample {sample.sample_id!r}: token id {bad} is outside the policy's "
                f"vocabulary [0, {vocab_size})"
            )
    rewards = {"reward": sample.reward} if sample.has_reward else {}
    rewards |= {f"rewards[{k!r}]": v for k, v in sample.rewards.items()}
    for name, value in rewards.items():
        if not math.isfinite(value):
            raise ContractError(f"Sample {sample.sample_id!r}: {name} is {value}")
    if n and sample.loss_mask[0]:
        raise ContractError(
            f"Sample {sample.sample_id!r}: loss_mask[0] is 1; token 0 has no context to score"
        )
    for position, (mask, logprob) in enumerate(
        zip(sample.loss_mask, sample.rollout_logprobs, strict=True)
    ):
        if mask and not (math.isfinite(logprob) and logprob <= 1e-4):
            raise ContractError(
                f"Sample {sample.sample_id!r}: rollout logprob {logprob} at sampled position "
                f"{position} is not a finite log-probability"
            )


def sample_temperature(sample: sample_pb2.Sample) -> float:
    """The temperature the sample was drawn at; 0 (greedy or unset) counts as 1.0."""
    temperature = sample.sampling.temperature
    return float(temperature) if temperature > 0 else 1.0


def truncated_sampling(sample: sample_pb2.Sample) -> bool:
    """Drawn from a truncated distribution (top_p < 1, top_k > 0, min_p > 0); 0 = unset."""
    s = sample.sampling
    return (0 < s.top_p < 1) or s.top_k > 0 or s.min_p > 0


def sample_lag(sample: sample_pb2.Sample, trainer_version: int) -> int:
    """Versions between the oldest sampled token's weights and the trainer's.

    A sampled token without a version (< 0) counts as version 0, the initial weights.
    """
    versions = [
        max(v, 0) for v, m in zip(sample.weight_versions, sample.loss_mask, strict=True) if m
    ]
    return trainer_version - min(versions) if versions else 0


def keepable_unjudged(sample: sample_pb2.Sample) -> bool:
    """Unjudged by the reward service but with other reward components; its `reward` is their
    weighted sum (what `trainer.data.unjudged = "keep"` trains on)."""
    return (
        not sample.has_reward
        and sample.error.startswith("unjudged:")
        and any("/" not in name for name in sample.rewards)
    )


def sampled_runs(loss_mask: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of 1s in `loss_mask`, in order.

    Example: [0, 1, 1, 0, 0, 1] -> [(1, 3), (5, 6)].
    """
    runs, start = [], None
    for position, value in enumerate(loss_mask):
        if value and start is None:
            start = position
        elif not value and start is not None:
            runs.append((start, position))
            start = None
    if start is not None:
        runs.append((start, len(loss_mask)))
    return runs


def step_reward_positions(sample: sample_pb2.Sample) -> dict[int, float] | None:
    """{token position: score} of the sample's per-turn scores ("step/<k>" rewards), each on the
    last sampled token of its turn; {} when it has none; None when they cannot be aligned.

    Alignment: "step/<k>" scores the k-th of the A assistant messages in `messages`; the loss
    mask has R sampled runs, one per sampled turn, and the sampled turns are the last R
    assistant messages (earlier ones, if any, were given in the first prompt, unsampled). So
    message k is run k - (A - R); a score of an unsampled message (k < A - R) has no trained
    token and is left out. R > A, a k >= A or a non-finite score cannot be aligned (None; the
    caller counts and logs it).

    Example: messages user, assistant, tool, assistant, tool, assistant (A = 3), loss mask with
    runs (5, 8), (10, 12), (14, 16) (R = 3), rewards {"step/0": 0.5, "step/1": -1.0} ->
    {7: 0.5, 11: -1.0}: the last tokens of the first two runs.
    """
    steps: dict[int, float] = {}
    for name, value in sample.rewards.items():
        match = STEP_REWARD.fullmatch(name)
        if match:
            steps[int(match.group(1))] = float(value)
    if not steps:
        return {}
    runs = sampled_runs(list(sample.loss_mask))
    assistants = sum(m.role == "assistant" for m in sample.messages)
    offset = assistants - len(runs)
    if offset < 0 or max(steps) >= assistants or not all(map(math.isfinite, steps.values())):
        return None
    return {runs[k - offset][1] - 1: value for k, value in sorted(steps.items()) if k >= offset}
