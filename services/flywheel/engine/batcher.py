"""Decode a batch of sequences together with one KV cache (static batching).

Prompts are left-padded to a common length; the attention mask marks real tokens and position
ids are `cumsum(mask) - 1`, so a row's numbers do not depend on its neighbours (greedy ids in a
batch equal the same request alone). One prefill pass over all prompts, then one token per step
for every unfinished row; finished rows are dropped from the cache (`batch_select_indices`), so
they stop costing compute.

Continuous batching would add rows between steps: a new row needs its own prefill and a cache
merge (pad the shorter cache on the left); `decode_batch` keeps the per-step state in
`_Batch`, so that change stays local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from flywheel.engine.runner import ModelRunner
from flywheel.engine.sampling import sample_tokens, tempered_logprobs, top_logprobs
from flywheel.engine.sequence import Sequence

_LOGIT_CHUNK = 512
"""Prompt positions projected to vocabulary logits at a time (bounds memory for long prompts)."""


@dataclass
class _Batch:
    seqs: list[Sequence]
    cache: DynamicCache
    mask: Tensor  # (B, T) 1 = real token
    positions: Tensor  # (B,) position id of the last token of each row


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Left-padded ids (B, T), attention mask (B, T) and position ids (B, T) from the mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def decode_batch(
    runner: ModelRunner,
    seqs: list[Sequence],
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Generate for every sequence until each one finishes; results stay on the sequences.

    Args:
        runner: the model.
        seqs: started sequences (`Sequence.start()` called); rows already finished still get
            their input logprobs.
        on_step: called with the number of tokens sampled in each step (metrics).
    """
    with torch.inference_mode():
        ids, mask, positions = left_pad([s.input_ids for s in seqs], runner.pad_id)
        cache = runner.new_cache()
        hidden = runner.hidden(ids, mask, positions, cache)  # (B, T, H)
        for i, seq in enumerate(seqs):
            if seq.wants_input_logprobs:
                _input_logprobs(runner, seq, hidden[i, ids.shape[1] - len(seq.input_ids) :])
        batch = _Batch(seqs, cache, mask, positions[:, -1])
        logits = _prune(batch, runner.logits(hidden[:, -1]))  # (B, V)
        while batch.seqs:
            tokens = _sample_step(runner, batch.seqs, logits)  # (B,)
            if on_step is not None:
                on_step(len(tokens))
            tokens = _prune(batch, tokens)
            if batch.seqs:
                logits = _step(runner, batch, tokens)


def _input_logprobs(runner: ModelRunner, seq: Sequence, hidden: Tensor) -> None:
    """Prompt logprobs from position L on: row 0 is null, row k scores input_ids[L + k]."""
    start = seq.job.spec.logprob_start_len
    k = seq.job.spec.top_logprobs_num
    ids = seq.input_ids
    seq.input_logprobs = [None] if start < len(ids) else []
    seq.input_top = [None] if start < len(ids) else []
    targets = torch.tensor(ids[start + 1 :], dtype=torch.long)
    for lo in range(start, len(ids) - 1, _LOGIT_CHUNK):
        hi = min(lo + _LOGIT_CHUNK, len(ids) - 1)
        logprobs = torch.log_softmax(runner.logits(hidden[lo:hi]), dim=-1)  # (C, V)
        chunk_targets = targets[lo - start : hi - start]
        picked = logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1)
        seq.input_logprobs.extend(picked.tolist())
        if k > 0:
            seq.input_top.extend(top_logprobs(row, k) for row in logprobs)


def _sample_step(runner: ModelRunner, seqs: list[Sequence], logits: Tensor) -> Tensor:
    configs = [s.config for s in seqs]
    logprobs = tempered_logprobs(logits, configs)  # (B, V)
    tokens = sample_tokens(logprobs, configs, [s.generator for s in seqs])  # (B,)
    picked = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    for i, (seq, token) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
        if seq.job.spec.top_logprobs_num > 0:
            seq.output_top.append(top_logprobs(logprobs[i], seq.job.spec.top_logprobs_num))
        seq.append(token, picked[i], runner.tokenizer)
        if seq.job.listener is not None and not seq.finished:
            notify(seq, runner)
    return tokens


def notify(seq: Sequence, runner: ModelRunner) -> None:
    """Send a streaming row its cumulative response; a listener that fails is dropped."""
    listener = seq.job.listener
    if listener is None:
        return
    try:
        listener(seq.result(runner.tokenizer))
    except Exception:  # the client's event loop is gone: nobody is listening any more
        seq.job.listener = None


def _prune(batch: _Batch, rows: Tensor) -> Tensor:
    """Drop finished rows from the batch state and the cache; return `rows` of the kept ones."""
    keep = [i for i, s in enumerate(batch.seqs) if not s.finished]
    if len(keep) == len(batch.seqs):
        return rows
    index = torch.tensor(keep, dtype=torch.long)
    batch.seqs = [batch.seqs[i] for i in keep]
    if keep:
        batch.cache.batch_select_indices(index)
        batch.mask = batch.mask[index]
        batch.positions = batch.positions[index]
    return rows[index]


def _step(runner: ModelRunner, batch: _Batch, tokens: Tensor) -> Tensor:
    """Feed the last sampled token of every row; return next-token logits (B, V)."""
    batch.mask = torch.cat([batch.mask, torch.ones((len(tokens), 1), dtype=torch.long)], dim=1)
    batch.positions = batch.positions + 1
    hidden = runner.hidden(
        tokens.unsqueeze(1), batch.mask, batch.positions.unsqueeze(1), batch.cache
    )
    return runner.logits(hidden[:, -1])
